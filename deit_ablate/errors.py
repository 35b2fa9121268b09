"""The error types a run stops with: a message that names the problem and the fix, never a traceback."""


class ConfigError(ValueError):
    """A run cannot start as configured; the message says what is wrong and how to fix it."""


class RunError(RuntimeError):
    """A run cannot go on (its folder is in use, the disk is full); the message says why and what to do."""
