"""Building token maps: from a corpus (count, then rank) or from saved counts (rank only)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from sglang_frspec.maps.counting import count_tokens
from sglang_frspec.maps.counts_file import TokenCounts
from sglang_frspec.maps.errors import MapBuildError
from sglang_frspec.maps.ranking import check_map_size, top_token_ids
from sglang_frspec.maps.tokenizer import (
    eos_token_ids,
    load_tokenizer,
    names_an_id,
    resolve_tokens,
    token_id_space,
    vocab_id_space,
)


def build_token_map(
    tokenizer_path: str,
    corpus: Sequence[str | os.PathLike],
    size: int,
    *,
    include: Sequence[str | int] = (),
    text_field: str = "text",
    workers: int = 1,
    max_tokens: int | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, TokenCounts]:
    """The ``size`` most frequent ids over the corpus (EOS and ``include`` always kept) and the counts.

    The size and included tokens are checked before any counting, so mistakes fail at once.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    id_space = token_id_space(tokenizer)
    forced = eos_token_ids(tokenizer, tokenizer_path) + resolve_tokens(
        include, id_space, tokenizer, f"tokenizer {tokenizer_path!r}"
    )
    check_map_size(size, id_space, forced)
    counts = count_tokens(
        tokenizer_path,
        corpus,
        text_field=text_field,
        workers=workers,
        max_tokens=max_tokens,
        progress=progress,
        tokenizer=tokenizer,
    )
    return top_token_ids(counts.counts, size, forced), counts


def rebuild_token_map(
    counts: TokenCounts, size: int, *, include: Sequence[str | int] = (), tokenizer_path: str | None = None
) -> torch.Tensor:
    """A map of another size from saved counts: the counted EOS ids and ``include`` are kept.

    Token strings in ``include`` need a tokenizer: ``tokenizer_path``, else the one counted with.
    """
    forced = counts.eos_token_ids
    needs_tokenizer = not all(map(names_an_id, include))
    tokenizer = None
    if tokenizer_path or (needs_tokenizer and counts.tokenizer):
        tokenizer_path = tokenizer_path or counts.tokenizer
        tokenizer = load_tokenizer(tokenizer_path)
        space = token_id_space(tokenizer)
        if counts.server is None and counts.speculative is None:
            if space != counts.id_space:
                raise MapBuildError(
                    f"tokenizer {tokenizer_path!r}: has {space} ids, but the counts "
                    f"were made with a tokenizer of {counts.id_space} ids ({counts.tokenizer!r})."
                )
        # Counts of a model's outputs (a server's or a serving plugin's) span the model's vocab, which
        # may be padded past the tokenizer's ids or end before tokens the tokenizer adds past it.
        elif vocab_id_space(tokenizer) > counts.id_space:
            raise MapBuildError(
                f"tokenizer {tokenizer_path!r}: its vocab has {vocab_id_space(tokenizer)} ids, more than the "
                f"{counts.id_space} ids of the model whose outputs were counted ({counts.tokenizer!r})."
            )
        forced += eos_token_ids(tokenizer, tokenizer_path)
    forced += resolve_tokens(include, counts.id_space, tokenizer, f"tokenizer {tokenizer_path!r}")
    return top_token_ids(counts.counts, size, forced)
