"""Which exchange runs: the one a processor is built with, and under ``auto`` the pick per step.

``exchange_at_start`` falls back to ``full`` where the top-k packet cannot apply (k >= H) or
cannot give what the verify needs (rejection sampling reads the draft's whole distribution);
``exchange_for_step`` gives a step's exchange, which under ``auto`` is full or topk per batch
size, by a rule every rank evaluates alike.

The choice must be identical on every rank (each rank runs its side of one collective), so it
is a pure function of what every rank of the group shares: the plan, the row count (the
collective's shapes already require it to be equal on all ranks), k, the logits' itemsize and
the device type. Never a timing: timings differ per rank.

What it rests on (docs/benchmarks.md):
- cpu (gloo): the top-k exchange was no slower than the full gather at 1, 8 and 64 rows at TP=2,
  for both layouts (bench_draft_head.py); gloo moves bytes slowly, so the packet always pays.
- cuda: on an H200 the per-rank work of the torch packet costs 50-120 us per step
  (bench_head_gemm.py), while NVLink gathers the full slices fast; at an all-gather rate of
  about 350 GB/s (NVLink-class, not measured in this project) 50 us moves ~17 MB. So topk is
  chosen only once the full gather would move at least 16 MiB per step, which none of the
  measured H200 shapes (up to 7 MB: TP=2, local layout, 64 rows) reaches. PCIe or multi-node
  links cannot be told apart from NVLink here: choose ``topk`` there explicitly.
"""

from __future__ import annotations

from sglang_frspec.core.gather import EXCHANGES, topk_packet_applies
from sglang_frspec.core.plan import HotShardPlan

AUTO = "auto"
EXCHANGE_CHOICES = (*EXCHANGES, AUTO)
# Bytes per step the full gather must move (rows x tp x width x itemsize) before topk is chosen.
TOPK_MIN_GATHER_BYTES = {"cpu": 0}
DEFAULT_TOPK_MIN_GATHER_BYTES = 16 * 2**20  # cuda and any other accelerator


def exchange_at_start(requested: str, plan: HotShardPlan, k: int, *, needs_distribution: bool = False) -> str:
    """The exchange a processor is built with: ``requested``, or ``full`` (exact, and as cheap)
    where the top-k packet cannot apply, or where the draft's whole distribution is needed
    (``needs_distribution``: rejection sampling draws drafts from q and verifies with q). The
    packet's fill value carries the rest mass at temperature 1 only, so softmax(logits / T) of
    the packet is not the draft's q at another temperature, nor is its top-k/top-p filtering."""
    if needs_distribution or not topk_packet_applies(k, plan.num_hot):
        return "full"
    return requested


def exchange_for_step(configured: str, plan: HotShardPlan, rows: int, k: int, itemsize: int,
                      device_type: str) -> str:  # fmt: skip
    """The exchange of one step of ``rows`` logits rows: ``configured`` (from
    ``exchange_at_start``), or under ``auto`` the rule's pick."""
    if configured != AUTO:
        return configured
    return auto_exchange(plan, rows, k, itemsize, device_type)


def auto_exchange(plan: HotShardPlan, rows: int, k: int, itemsize: int, device_type: str) -> str:
    """``full`` or ``topk`` for a step of ``rows`` logits rows (the same answer on every rank)."""
    if plan.tp_size == 1 or not topk_packet_applies(k, plan.num_hot):
        return "full"  # no collective (full is a slice), or no valid top-k packet
    gathered = rows * plan.gathered_bytes_per_row(itemsize)
    threshold = TOPK_MIN_GATHER_BYTES.get(device_type, DEFAULT_TOPK_MIN_GATHER_BYTES)
    return "topk" if gathered >= threshold and rows > 0 else "full"
