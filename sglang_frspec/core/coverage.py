"""Coverage of a token map over the tokens the target commits, counted on the device.

A draft with a token map can only propose hot ids, so the share of committed tokens that are hot
is the ceiling of what its proposals can match. ``CommittedTokenCounts`` keeps int64 counters per
token id on the device and adds a verify step's committed tokens (for each request, the accepted
draft tokens and the bonus token: the first ``accept_lens[i]`` ids of row i) with a few
fixed-shape kernels and no host sync. It counts the accepted draft tokens (the first
``accept_lens[i] - 1``) and the verified request-steps too: which ids the drafts get right is what
a smaller map would lose, and committed tokens per request-step is the accept length. Totals are
derived from the counters, so the hot set costs nothing per step. A token is "in the map" against
the map in force when it was committed: when the map changes (the adaptive map's swaps call
``map_changed()``), what the old map held is banked, so the in-map total never falls and means
the same before and after. ``snapshot()`` copies the totals to the host in stream order without
waiting; ``PendingSnapshot.ready()`` says when the copy has landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CoverageTotals:
    """Committed tokens counted so far, how many of them were in the map then, optionally per id."""

    committed: int
    in_map: int  # committed while the map held them (an adaptive map may have swapped them out since)
    accepted: int = 0  # of the committed tokens, the accepted draft tokens (the rest are bonus tokens)
    verify_rows: int = 0  # request-steps verified: each commits its accepted drafts and one bonus token
    counts: torch.Tensor | None = None  # int64 [vocab_size] on the CPU, when asked for
    accepted_counts: torch.Tensor | None = None  # int64 [vocab_size]: the accepted drafts per id

    @property
    def accept_length(self) -> float | None:
        """Committed tokens per verified request-step, as the ``accept len`` of SGLang's decode log."""
        return self.committed / self.verify_rows if self.verify_rows else None

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
        self._totals = totals  # int64 [4] on the host (pinned on CUDA)
        self._counts = counts  # int64 [2, vocab_size] on the host (committed, accepted), or None
        self._event = event  # a CUDA event recorded after the copies; None when already on the host

    def ready(self) -> bool:
        """True once the copies have landed (never blocks)."""
        return self._event is None or self._event.query()

    def result(self) -> CoverageTotals:
        """The totals at the time of ``snapshot()`` (waits for the copies if they are not ready)."""
        if self._event is not None:
            self._event.synchronize()
        committed, in_map, accepted, verify_rows = self._totals.tolist()
        # Own copies, not views of one [2, V] storage (torch.save would write all of it for each).
        counts, accepted_counts = (None, None) if self._counts is None else (r.clone() for r in self._counts)
        return CoverageTotals(committed, in_map, accepted, verify_rows, counts, accepted_counts)


class CommittedTokenCounts:
    """Per-id counts of committed tokens (and of accepted drafts) on the device, without host syncs."""

    def __init__(self, hot_ids: torch.Tensor, vocab_size: int):
        if hot_ids.dtype != torch.int64 or hot_ids.dim() != 1:
            raise ValueError(
                f"hot ids must be a 1-D int64 tensor, got {hot_ids.dtype} {tuple(hot_ids.shape)}"
            )
        self.vocab_size = vocab_size
        self.hot_ids = hot_ids
        device = hot_ids.device
        # Row 0 counts committed tokens, row 1 accepted drafts. Slot vocab_size (the overflow) of
        # each row collects the positions past the row's length and any id outside the vocab,
        # which must not index out of bounds; it is never reported.
        self.counts = torch.zeros(2, vocab_size + 1, dtype=torch.int64, device=device)
        self.verify_rows = torch.zeros((), dtype=torch.int64, device=device)
        # The map in force since the last change, and what the in-map total adds to its ids' counts:
        # the committed tokens earlier maps held, less the counts the map's ids had when it came in.
        self._map = hot_ids.clone()
        self._in_map_offset = torch.zeros((), dtype=torch.int64, device=device)
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
        if self._ones.numel() < 2 * token_ids.numel():  # grows to the largest batch seen
            self._ones = torch.ones(2 * token_ids.numel(), dtype=torch.int64, device=self.counts.device)
        lengths = accept_lens.unsqueeze(1)
        # Committed: the first accept_lens[i] positions; accepted drafts: all of them but the bonus.
        counted = torch.stack((self._positions < lengths, self._positions < lengths - 1))
        slots = torch.where(counted, token_ids.view(1, rows, stride), -1)
        # Uncounted positions and ids outside [0, vocab_size) (SGLang's "NaN happened" ids) go
        # to the overflow slot: clamp to [-1, vocab_size], then -1 wraps to vocab_size.
        slots.clamp_(-1, self.vocab_size).remainder_(self.vocab_size + 1)
        slots[1] += self.vocab_size + 1  # into row 1 of the flattened counters
        self.counts.view(-1).index_add_(0, slots.view(-1), self._ones[: 2 * token_ids.numel()])
        self.verify_rows += (accept_lens > 0).sum()
        if self.counts.is_cuda:
            self._stream = torch.cuda.current_stream(self.counts.device)

    def map_changed(self) -> None:
        """Count later tokens against ``hot_ids`` as it is now (call after rewriting it in place,
        before the next ``add``); what the old map held so far stays counted. No host sync."""
        committed = self.counts[0]
        self._in_map_offset += committed[self._map].sum() - committed[self.hot_ids].sum()
        self._map.copy_(self.hot_ids)

    def snapshot(self, with_counts: bool = False) -> PendingSnapshot:
        """Start copying the totals (and the per-id counts) to the host; never blocks."""
        if not self.counts.is_cuda:
            return PendingSnapshot(
                self._totals(), self.counts[:, : self.vocab_size].clone() if with_counts else None, None
            )
        stream = self._stream or torch.cuda.current_stream(self.counts.device)
        with torch.cuda.stream(stream):
            totals = torch.empty(4, dtype=torch.int64, pin_memory=True)
            totals.copy_(self._totals(), non_blocking=True)
            counts = None
            if with_counts:
                counts = torch.empty(2, self.vocab_size, dtype=torch.int64, pin_memory=True)
                counts.copy_(self.counts[:, : self.vocab_size], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return PendingSnapshot(totals, counts, event)

    def _totals(self) -> torch.Tensor:
        committed, accepted = self.counts[:, : self.vocab_size]
        in_map = committed[self._map].sum() + self._in_map_offset
        return torch.stack((committed.sum(), in_map, accepted.sum(), self.verify_rows))
