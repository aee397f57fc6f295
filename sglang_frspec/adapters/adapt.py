"""Seam 7: the adaptive hot set while serving (``SGLANG_FRSPEC_ADAPT=1``, see ``core.adapt``).

Every ``SGLANG_FRSPEC_ADAPT_INTERVAL`` verify steps (counted by the coverage hook, on every rank
of the group alike), TP rank 0 decides from the decayed counts of the committed tokens which ids
swap, and every rank applies the same decision before the next forward pass: ``hot_token_id`` and
the rows of its hot head are rewritten **in place** (same tensors, same addresses, so SGLang's
captured draft graphs stay valid). Each new row is read from the vocab shard that holds it (a
quantized head's dequantized, as at start-up), looked up at each decision as a refresh does (an
update may give the head a new tensor), and, under the balanced layout, sent to the rank
that computes its position in bounded steps that every rank joins (``place_hot_rows``). The
plan's hot ids are the same ids (rewritten with them), so a weight-update refresh rebuilds the
current set.

Every rank must run every decision, so what the launcher refuses (a PD node, DP attention, where
an idle rank skips the verify hook) is checked again here, on every rank, with one agreed error.
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.srt.runtime_context import get_disagg, get_parallel

from sglang_frspec.adapters.head import hot_row_reader
from sglang_frspec.adapters.pd import PD_MODES
from sglang_frspec.adapters.worker import FrSpecDraftHead, agree_across_ranks, map_status
from sglang_frspec.core import UnsupportedSetupError, canonical_hot_ids
from sglang_frspec.core.adapt import Swaps, check_adaptation_setup, choose_swaps, decay_scores, swap_groups
from sglang_frspec.core.coverage import CommittedTokenCounts
from sglang_frspec.core.gather import place_hot_rows

logger = logging.getLogger(__name__)

SWAPS_PER_DECISION_SHARE = 4  # at most H / 4 ids change per decision


class HotSetAdapter:
    """One scheduler rank's side of the adaptation (decides on TP rank 0, applies everywhere)."""

    def __init__(self, head: FrSpecDraftHead, hot_token_id: torch.Tensor, counts: CommittedTokenCounts,
                 interval: int, protected: tuple[int, ...]):  # fmt: skip
        hot = canonical_hot_ids(head.plan.hot_ids, counts.vocab_size)  # the map every rank starts from
        try:
            mode = get_disagg().disaggregation_mode
            check_adaptation_setup(mode if mode in PD_MODES else None, get_parallel().attn_dp_size > 1)
            status = map_status(hot)
        except UnsupportedSetupError as e:
            status = ("error", type(e).__name__, str(e))
        agree_across_ranks(status, get_parallel().tp_group)  # every rank raises, or none
        self.groups = swap_groups(head.plan)
        self.head = head
        self.hot_token_id = hot_token_id
        self.counts = counts
        self.interval = interval
        self.max_swaps = max(1, head.plan.num_hot // SWAPS_PER_DECISION_SHARE)
        self.protected = torch.tensor(sorted(protected), dtype=torch.int64, device=hot_token_id.device)
        self.steps = 0
        self.swapped = 0  # ids swapped in since start-up
        self.decides = get_parallel().tp_rank == 0
        if self.decides:
            self.scores = torch.zeros(counts.vocab_size, dtype=torch.int64, device=hot_token_id.device)
            self.seen = torch.zeros_like(self.scores)  # committed counts at the last decision

    def describe(self) -> str:
        return (
            f"adaptive map on: a decision every {self.interval} verify steps, at most {self.max_swaps} "
            f"swaps each, in place (hot_token_id at {self.hot_token_id.data_ptr():#x}, hot head at "
            f"{self.head.local_head.data_ptr():#x})"
        )

    def after_verify(self) -> None:
        """Called once per verify step on every rank; every interval, decide and apply."""
        self.steps += 1
        if self.steps % self.interval:
            return
        started = time.perf_counter()
        decision = self._decide() if self.decides else None
        group = get_parallel().tp_group
        if group.world_size > 1:  # rank 0's decision, on the CPU group (every rank is here)
            decision = group.all_gather_object(decision)[0]
        if decision is None:
            return
        exchanged = self._apply(decision)
        if self.decides:
            self._log(decision, time.perf_counter() - started, exchanged)

    def _decide(self) -> dict | None:
        committed = self.counts.counts[0, : self.counts.vocab_size]
        since = committed - self.seen
        self.seen.copy_(committed)
        decay_scores(self.scores, since)
        swaps = choose_swaps(self.scores, self.hot_token_id, self.groups, self.protected, self.max_swaps,
                             committed=committed)  # fmt: skip
        if not len(swaps):
            return None
        after = self.hot_token_id.clone()
        after[swaps.positions] = swaps.ids_in
        return {
            "positions": swaps.positions.tolist(),
            "ids_in": swaps.ids_in.tolist(),
            "ids_out": swaps.ids_out.tolist(),
            # Of the tokens committed since the last decision: in the map before, in the new map, all.
            "coverage": (int(since[self.hot_token_id].sum()), int(since[after].sum()), int(since.sum())),
        }

    def _apply(self, decision: dict) -> int:
        """Rewrite hot_token_id, the plan's ids and the head's rows; the bytes of rows all-gathered."""
        device = self.hot_token_id.device
        keys = ("positions", "ids_in", "ids_out")
        swaps = Swaps(*(torch.tensor(decision[key], dtype=torch.int64) for key in keys))
        self.hot_token_id.index_copy_(0, swaps.positions.to(device), swaps.ids_in.to(device))
        self.head.plan.hot_ids.index_copy_(0, swaps.positions, swaps.ids_in)  # the ids a refresh re-reads
        head, shard = self.head, self.head.shard
        # A reader of the head's tensor now: a weight update may replace it (a new Parameter, or
        # new storage under `.data`) rather than copy into it, and the refresh read the new one.
        read_rows = hot_row_reader(shard)
        exchanged = place_hot_rows(read_rows, swaps.ids_in, head.plan, shard.rank, shard.all_gather,
                                   head.local_head, positions=swaps.positions)  # fmt: skip
        self.swapped += len(swaps)
        return exchanged

    def _log(self, decision: dict, seconds: float, exchanged: int) -> None:
        before, after, total = decision["coverage"]
        share = (lambda n: f"{n / total:.2%}") if total else (lambda n: "n/a")
        logger.info(
            "sglang-frspec: map adapted after %d verify steps: %d id(s) in %s, out %s; the last "
            "interval's committed tokens in the map %s -> %s; decision %.1f ms, %d B of rows "
            "all-gathered per rank (in place at %#x, %#x)",
            self.steps,
            len(decision["ids_in"]),
            decision["ids_in"][:8],
            decision["ids_out"][:8],
            share(before),
            share(after),
            seconds * 1e3,
            exchanged,
            self.hot_token_id.data_ptr(),
            self.head.local_head.data_ptr(),
        )
