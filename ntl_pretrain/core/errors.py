"""The error a user's configuration causes, shared by every layer that checks a setting."""


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message names the key and the fix."""
