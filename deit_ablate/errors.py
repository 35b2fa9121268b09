"""The one error type for bad input: a message that names the problem and the fix."""


class ConfigError(ValueError):
    """A run cannot start as configured; the message says what is wrong and how to fix it."""
