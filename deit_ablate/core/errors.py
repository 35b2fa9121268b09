"""The error types a run stops with: a message that names the problem and the fix, never a traceback."""


class ConfigError(ValueError):
    """A run cannot start as configured; the message says what is wrong and how to fix it."""


class DataError(ConfigError):
    """The data stopped a run part-way (an unreadable image): only the rank that read it knows, so it says so."""


class RunError(RuntimeError):
    """A run cannot go on (its folder is in use, the disk is full); the message says why and what to do."""


class RunInUse(RunError):
    """Another launch trains the run, or the run it starts from, now: a sweep leaves the run, goes on with the
    others and names it at its end."""


def no_access(error: PermissionError) -> ConfigError:
    """The one-line error for a file or folder this user may not read or write (a teammate's run, a shared cache)."""
    where = error.filename or "a file"
    return ConfigError(f"{where} cannot be opened by this user ({error.strerror or error}). Ask its owner for access "
                       "(for a group: chmod -R g+rX on what is read, g+w on folders written to; files written from now "
                       "on follow the umask, 0644/0664 under umask 022/002), or use a copy you can read.")
