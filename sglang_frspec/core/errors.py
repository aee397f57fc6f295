"""Errors raised before any device work; each message names the problem and the fix."""


class TokenMapError(ValueError):
    """A token map that cannot be used (missing, unreadable, malformed or out of range)."""


class UnsupportedSetupError(ValueError):
    """A server setting this plugin cannot serve a token map with."""
