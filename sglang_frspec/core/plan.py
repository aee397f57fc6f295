"""Shard plans: which rank computes which hot columns of the draft LM head (torch only).

The target LM head is vocab-parallel: rank r holds the rows of the original vocab range
``shard_ranges[r]``. A plan assigns the H canonical hot ids to ranks as contiguous runs of the
hot order: rank r computes hot columns ``[offsets[r], offsets[r] + counts[r])`` in the first
``counts[r]`` of its ``width`` slots (the rest are zero padding). A rank-major all-gather of
``[T, width]`` slices then holds hot column j at position ``rank * width + (j - offsets[rank])``.

Layouts:
  local     rank r computes the hot ids inside its own vocab shard (rows it already holds);
            counts follow the map's skew, width = max count rounded up to 8.
  balanced  every rank computes ceil(H/tp) or floor(H/tp) hot columns (at most one padding
            slot per rank), whatever the skew; rows are exchanged at start-up (and, with
            SGLANG_FRSPEC_ADAPT=1, the swapped-in rows at each decision).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from sglang_frspec.core.token_map import canonical_hot_ids

LAYOUTS = ("local", "balanced")
DEFAULT_VOCAB_PADDING_SIZE = 64  # SGLang's vocab_parallel_embedding default
_WIDTH_ALIGN = 8  # local-layout slot count is rounded up to this (aligned collectives/GEMMs)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def vocab_shard_ranges(
    vocab_size: int, tp_size: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE
) -> tuple[tuple[int, int], ...]:
    """Original-vocab range [start, end) held by each rank of a vocab-parallel LM head.

    The same arithmetic as SGLang's ``VocabParallelEmbedding``: pad the vocab to
    ``padding_size`` (times ``tp_size`` when that padded size does not divide), give each rank
    an equal slice of the padded vocab, and clip the slices to the real vocab.
    """
    if vocab_size <= 0 or tp_size <= 0 or padding_size <= 0:
        raise ValueError(f"need positive sizes, got {vocab_size=}, {tp_size=}, {padding_size=}")
    unit = padding_size
    if _round_up(vocab_size, unit) % tp_size:
        unit *= tp_size
    per_rank = _round_up(vocab_size, unit) // tp_size
    return _clipped_slices(vocab_size, tp_size, per_rank)


def table_slice_ranges(vocab_size: int, tp_size: int) -> tuple[tuple[int, int], ...]:
    """Rows [start, end) each rank slices out of a table that every rank holds whole.

    SGLang's Gemma 3 hands the draft ``table[r * ceil(V/tp) : (r + 1) * ceil(V/tp)]`` as rank r's
    head (no padding to 64, unlike a ``VocabParallelEmbedding``), clipped to the table.
    """
    if vocab_size <= 0 or tp_size <= 0:
        raise ValueError(f"need positive sizes, got {vocab_size=}, {tp_size=}")
    return _clipped_slices(vocab_size, tp_size, -(-vocab_size // tp_size))


def _clipped_slices(vocab_size: int, tp_size: int, per_rank: int) -> tuple[tuple[int, int], ...]:
    return tuple((min(r * per_rank, vocab_size), min((r + 1) * per_rank, vocab_size)) for r in range(tp_size))


@dataclass(frozen=True)
class HotShardPlan:
    """Assignment of canonical hot ids to the ranks of the group that shards the LM head."""

    hot_ids: torch.Tensor  # int64 [H], ascending (until adaptation swaps); column j is token hot_ids[j]
    shard_ranges: tuple[tuple[int, int], ...]  # vocab range of each rank's head shard
    layout: str
    counts: tuple[int, ...]  # hot columns each rank computes
    width: int  # slots per rank (padded, equal on every rank)

    @property
    def tp_size(self) -> int:
        return len(self.shard_ranges)

    @property
    def num_hot(self) -> int:
        return int(self.hot_ids.numel())

    @property
    def offsets(self) -> tuple[int, ...]:
        """Hot position of each rank's first column."""
        return (0, *accumulate(self.counts))[:-1]

    @property
    def owned_counts(self) -> tuple[int, ...]:
        """Hot ids inside each rank's vocab shard (the rows each rank can read locally)."""
        return _owned_counts(self.hot_ids, self.shard_ranges)

    def owned_rows(self, rank: int) -> torch.Tensor:
        """Local row indices, in this rank's head shard, of the hot ids it owns."""
        start, end = self.shard_ranges[rank]
        mine = self.hot_ids[(self.hot_ids >= start) & (self.hot_ids < end)]
        return mine - start

    @property
    def column_ranks(self) -> torch.Tensor:
        """Rank that computes each hot column, int64 [H]."""
        return torch.repeat_interleave(
            torch.arange(self.tp_size), torch.tensor(self.counts, dtype=torch.int64)
        )

    @property
    def column_slots(self) -> torch.Tensor:
        """Slot, within its rank's ``width``, of each hot column, int64 [H]."""
        offsets = torch.tensor(self.offsets, dtype=torch.int64)
        return torch.arange(self.num_hot) - offsets[self.column_ranks]

    @property
    def gather_columns(self) -> torch.Tensor:
        """Position of each hot column in a rank-major ``[tp * width]`` gather, int64 [H]."""
        return self.column_ranks * self.width + self.column_slots

    @property
    def compaction_is_slice(self) -> bool:
        """True when the gathered columns are already in hot order (no padding in between)."""
        last = max(r for r, c in enumerate(self.counts) if c)
        return all(c == self.width for c in self.counts[:last])

    @property
    def imbalance(self) -> float:
        """Largest per-rank column count over the mean (1.0 is perfectly balanced)."""
        return max(self.counts) * self.tp_size / self.num_hot

    def gathered_bytes_per_row(self, itemsize: int) -> int:
        """Bytes gathered per logits row by the full (padded) exchange; 0 without a collective."""
        return self.tp_size * self.width * itemsize if self.tp_size > 1 else 0

    def topk_bytes_per_row(self, k: int) -> int:
        """Bytes gathered per logits row by the top-k exchange (k values, k indices, one
        log-sum-exp per rank, float32); 0 without a collective."""
        return self.tp_size * (2 * k + 1) * 4 if self.tp_size > 1 else 0

    def describe(self, itemsize: int = 4, k: int = 4) -> dict:
        """Plain-data summary (for `sglang-frspec plan --json` and logs)."""
        mean = self.num_hot / self.tp_size
        return {
            "layout": self.layout,
            "num_hot": self.num_hot,
            "tp_size": self.tp_size,
            "width": self.width,
            "imbalance_max_over_mean": round(self.imbalance, 4),
            "mean_columns_per_rank": round(mean, 2),
            "gathered_bytes_per_row": self.gathered_bytes_per_row(itemsize),
            f"topk{k}_bytes_per_row": self.topk_bytes_per_row(k),
            "ranks": [
                {
                    "rank": r,
                    "vocab_range": list(self.shard_ranges[r]),
                    "owned_hot_ids": self.owned_counts[r],
                    "columns": self.counts[r],
                    "hot_positions": [self.offsets[r], self.offsets[r] + self.counts[r]],
                    "padding_slots": self.width - self.counts[r],
                }
                for r in range(self.tp_size)
            ],
        }


def _owned_counts(hot_ids: torch.Tensor, ranges) -> tuple[int, ...]:
    return tuple(int(((hot_ids >= s) & (hot_ids < e)).sum()) for s, e in ranges)


def plan_from_ranges(hot_ids: torch.Tensor, shard_ranges, layout: str = "local") -> HotShardPlan:
    """Plan for canonical (ascending, unique) hot ids over the given per-rank vocab ranges."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    shard_ranges = tuple((int(s), int(e)) for s, e in shard_ranges)
    hot_ids = hot_ids.to(torch.int64)
    num_hot, tp_size = int(hot_ids.numel()), len(shard_ranges)
    if num_hot == 0:
        raise ValueError("a plan needs at least one hot id")
    owned = _owned_counts(hot_ids, shard_ranges)
    if sum(owned) != num_hot:
        raise ValueError(f"{num_hot - sum(owned)} hot id(s) fall outside every shard range {shard_ranges}")
    if layout == "local":
        counts = owned
        width = _round_up(max(counts), _WIDTH_ALIGN)
    else:
        base, extra = divmod(num_hot, tp_size)
        counts = tuple(base + (r < extra) for r in range(tp_size))
        width = base + (extra > 0)
    return HotShardPlan(hot_ids=hot_ids, shard_ranges=shard_ranges, layout=layout, counts=counts, width=width)


def plan_hot_shards(
    hot_ids,
    vocab_size: int,
    tp_size: int,
    *,
    padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    layout: str = "local",
) -> HotShardPlan:
    """Canonicalise a token map (sort, de-duplicate, range-check) and plan it over tp ranks."""
    ids = torch.as_tensor(hot_ids, dtype=torch.int64)
    hot = canonical_hot_ids(ids, vocab_size).ids
    return plan_from_ranges(hot, vocab_shard_ranges(vocab_size, tp_size, padding_size), layout)
