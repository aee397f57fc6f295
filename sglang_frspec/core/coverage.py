"""Coverage of a token map over the tokens the target commits, counted on the device.

A draft with a token map can only propose hot ids, so the share of committed tokens that are hot
is the ceiling of what its proposals can match. ``CommittedTokenCounts`` keeps one int64 counter
per token id on the device and adds a verify step's committed tokens (for each request, the
accepted draft tokens and the bonus token: the first ``accept_lens[i]`` ids of row i) with a few
fixed-shape kernels and no host sync. Totals (committed, in the map) are derived from the
counters, so the hot set costs nothing per step. ``snapshot()`` copies them to the host in stream
order without waiting; ``PendingSnapshot.ready()`` says when the copy has landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CoverageTotals:
    """Committed tokens counted so far, how many of them the map holds, and optionally per id."""

    committed: int
    in_map: int
    counts: torch.Tensor | None = None  # int64 [vocab_size] on the CPU, when asked for

    @property
    def coverage(self) -> float | None:
        return self.in_map / self.committed if self.committed else None

    def describe(self) -> str:
        """``hot coverage 97.80% (12,075 of 12,345 committed tokens in the token map)``."""
        if self.coverage is None:
            return "hot coverage n/a (no committed tokens yet)"
        return (
            f"hot coverage {self.coverage:.2%} ({self.in_map:,} of {self.committed:,} committed tokens "
            "in the token map)"
        )


class PendingSnapshot:
    """Totals copied to the host in the order of the stream that counts; ``result()`` reads them."""

    def __init__(self, totals: torch.Tensor, counts: torch.Tensor | None, event):
        self._totals = totals  # int64 [2] on the host (pinned on CUDA)
        self._counts = counts  # int64 [vocab_size] on the host, or None
        self._event = event  # a CUDA event recorded after the copies; None when already on the host

    def ready(self) -> bool:
        """True once the copies have landed (never blocks)."""
        return self._event is None or self._event.query()

    def result(self) -> CoverageTotals:
        """The totals at the time of ``snapshot()`` (waits for the copies if they are not ready)."""
        if self._event is not None:
            self._event.synchronize()
        committed, in_map = self._totals.tolist()
        return CoverageTotals(committed, in_map, self._counts)


class CommittedTokenCounts:
    """Per-id counts of committed tokens on the device, updated without host syncs."""

    def __init__(self, hot_ids: torch.Tensor, vocab_size: int):
        if hot_ids.dtype != torch.int64 or hot_ids.dim() != 1:
            raise ValueError(
                f"hot ids must be a 1-D int64 tensor, got {hot_ids.dtype} {tuple(hot_ids.shape)}"
            )
        self.vocab_size = vocab_size
        self.hot_ids = hot_ids
        device = hot_ids.device
        # Slot vocab_size (the overflow) collects the positions past each row's accept length and
        # any id outside the vocab, which must not index out of bounds; it is never reported.
        self.counts = torch.zeros(vocab_size + 1, dtype=torch.int64, device=device)
        self._positions = torch.arange(0, dtype=torch.int64, device=device)
        self._ones = torch.ones(0, dtype=torch.int64, device=device)
        self._stream = None  # the CUDA stream of the last update: snapshots are ordered after it

    def add(self, token_ids: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> None:
        """Count the first ``accept_lens[i]`` ids of row i of ``token_ids`` viewed as ``[rows, stride]``."""
        rows = accept_lens.numel()
        if token_ids.numel() != rows * stride:
            raise ValueError(
                f"committed-token layout changed: {token_ids.numel()} token ids for {rows} accept "
                f"lengths of stride {stride} (expected {rows * stride}). Serve with "
                "SGLANG_FRSPEC_COVERAGE=0 and report this SGLang version."
            )
        if self._positions.numel() != stride:  # fixed per server; reallocated only if it changes
            self._positions = torch.arange(stride, dtype=torch.int64, device=self.counts.device)
        if self._ones.numel() < token_ids.numel():  # grows to the largest batch seen
            self._ones = torch.ones(token_ids.numel(), dtype=torch.int64, device=self.counts.device)
        committed = self._positions < accept_lens.unsqueeze(1)
        slots = torch.where(committed, token_ids.view(rows, stride), -1)
        # Uncommitted positions and ids outside [0, vocab_size) (SGLang's "NaN happened" ids) go
        # to the overflow slot: clamp to [-1, vocab_size], then -1 wraps to vocab_size.
        slots.clamp_(-1, self.vocab_size).remainder_(self.vocab_size + 1)
        self.counts.index_add_(0, slots.view(-1), self._ones[: token_ids.numel()])
        if self.counts.is_cuda:
            self._stream = torch.cuda.current_stream(self.counts.device)

    def snapshot(self, with_counts: bool = False) -> PendingSnapshot:
        """Start copying the totals (and the per-id counts) to the host; never blocks."""
        if not self.counts.is_cuda:
            return PendingSnapshot(
                self._totals(), self.counts[: self.vocab_size].clone() if with_counts else None, None
            )
        stream = self._stream or torch.cuda.current_stream(self.counts.device)
        with torch.cuda.stream(stream):
            totals = torch.empty(2, dtype=torch.int64, pin_memory=True)
            totals.copy_(self._totals(), non_blocking=True)
            counts = None
            if with_counts:
                counts = torch.empty(self.vocab_size, dtype=torch.int64, pin_memory=True)
                counts.copy_(self.counts[: self.vocab_size], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return PendingSnapshot(totals, counts, event)

    def _totals(self) -> torch.Tensor:
        counted = self.counts[: self.vocab_size]
        return torch.stack((counted.sum(), counted[self.hot_ids].sum()))
