"""Errors of the map tooling; each message names the problem and the fix."""

from sglang_frspec.core.errors import TokenMapError


class MapBuildError(TokenMapError):
    """A token map that cannot be built or inspected as asked (tokenizer, corpus, size, tokens, counts)."""
