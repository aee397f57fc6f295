"""Ranking counted tokens into a token map and saving it in the format SGLang and this plugin read."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from sglang_frspec.maps.errors import MapBuildError


def check_map_size(size: int, id_space: int, forced: Sequence[int] = ()) -> torch.Tensor:
    """Check that a map of ``size`` ids can hold the forced ids; returns them sorted and unique."""
    if not 1 <= size <= id_space:
        raise MapBuildError(f"map size {size}: must be between 1 and the tokenizer's {id_space} ids.")
    forced_ids = torch.tensor(sorted(set(forced)), dtype=torch.int64)
    outside = forced_ids[(forced_ids < 0) | (forced_ids >= id_space)]
    if outside.numel():
        raise MapBuildError(
            f"forced token ids {outside.tolist()}: outside the tokenizer's ids [0, {id_space})."
        )
    if forced_ids.numel() > size:
        raise MapBuildError(
            f"map size {size}: smaller than the {forced_ids.numel()} tokens it must include "
            f"({forced_ids.tolist()})."
        )
    return forced_ids


def top_token_ids(counts: torch.Tensor, size: int, forced: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent ids, most frequent first, ties broken by the smaller id.

    Every id in ``forced`` is kept whatever its count (a decoder must be able to emit EOS); each
    forced id that would fall outside the top ``size`` replaces the least frequent kept one.
    """
    forced_ids = check_map_size(size, int(counts.numel()), forced)
    # A stable descending sort keeps equal counts in id order, so ties go to the smaller id.
    order = torch.sort(counts, descending=True, stable=True).indices
    is_forced = torch.isin(order, forced_ids)
    free_slots = size - forced_ids.numel()
    return order[is_forced | ((~is_forced).cumsum(0) <= free_slots)]


def save_token_map(ids: torch.Tensor, path: str | os.PathLike) -> None:
    """Save hot ids as a 1-D int64 tensor (what ``--speculative-token-map`` loads)."""
    torch.save(ids.to(torch.int64).contiguous().clone(), path)
