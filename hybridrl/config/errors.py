"""Config error and warning types."""


class ConfigError(ValueError):
    """A config that cannot be loaded; the message names each offending key and what is allowed."""


class ConfigWarning(UserWarning):
    """A verl key accepted for compatibility that has no effect or was renamed."""
