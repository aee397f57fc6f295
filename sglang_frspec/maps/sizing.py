"""Choosing a map size: coverage from counts, head cost from the plan, and a speed model joining them.

The model, per candidate size N (the N most frequent counted ids):
- coverage c(N): the share of counted tokens inside the map. A draft can only propose ids in the
  map, so a committed token outside it can never be drafted; the model takes the per-token
  acceptance as ``alpha(N) = alpha * c(N)``, where ``alpha`` (no map) is solved from a measured
  accept length L of chain drafting with k steps: ``L = (1 - alpha^(k+1)) / (1 - alpha)``.
- head cost h(N): the slowest rank's draft-head work relative to the full-vocab shard, from the
  shard plan's width (columns per rank); linear in the rows streamed, or ``a + b * rows`` fitted to
  ``bench_head_gemm.py`` timings (the fixed part ``a`` makes small maps save less).
- step time ``T(N) = 1 - s * (1 - h(N))`` relative to EAGLE without a map, where s is the share of
  a speculative step (draft + verify) spent in the draft LM head without a map.
- modelled speed-up over no map: ``(L(N) / T(N)) / L``.
The recommended size is the one with the best modelled speed-up (the smaller one on a tie).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_frspec.core.plan import DEFAULT_VOCAB_PADDING_SIZE, plan_hot_shards, vocab_shard_ranges
from sglang_frspec.maps.errors import MapBuildError

# FR-Spec (Llama-3-8B): a 32k map cuts the LM head by 75% for 1.12x over EAGLE-2, which this model
# reproduces with s = 0.14 when acceptance barely moves (1 / (1 - 0.14 * 0.75) = 1.12).
DEFAULT_HEAD_SHARE = 0.14


@dataclass(frozen=True)
class HeadCostModel:
    """Draft-head time of one rank as ``fixed + per_row * rows`` (any unit; only ratios are used)."""

    fixed: float = 0.0
    per_row: float = 1.0
    source: str = "bytes streamed (linear in head rows)"

    def cost(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


@dataclass(frozen=True)
class SizeEstimate:
    size: int
    coverage: float
    columns: int  # head rows on the slowest rank
    head_mib: float  # those rows' bytes per rank
    head_cost: float  # relative to the full-vocab shard
    step_time: float  # relative to a speculative step without a map
    accept_length: float
    speedup: float  # modelled tokens/s vs EAGLE without a map


def acceptance_rate(accept_length: float, draft_steps: int) -> float:
    """Per-token acceptance alpha with ``(1 - alpha^(k+1)) / (1 - alpha) == accept_length``."""
    if not 1.0 <= accept_length <= draft_steps + 1:
        raise MapBuildError(
            f"--accept-length {accept_length}: must be between 1 and --draft-steps + 1 ({draft_steps + 1}); "
            "pass the spec_accept_length measured without a map and the --speculative-num-steps used."
        )
    low, high = 0.0, 1.0
    for _ in range(60):
        alpha = (low + high) / 2
        if chain_accept_length(alpha, draft_steps) < accept_length:
            low = alpha
        else:
            high = alpha
    return (low + high) / 2


def chain_accept_length(alpha: float, draft_steps: int) -> float:
    """Expected tokens per verify of a k-step chain with per-token acceptance alpha (bonus included)."""
    return sum(alpha**i for i in range(draft_steps + 1))


def calibrated_cost_model(path: str | os.PathLike, tp: int, rows: int | None = None) -> HeadCostModel:
    """``a + b * head rows`` fitted (least squares) to the GEMM variants of a ``bench_head_gemm.py --json``
    run at this tp (and batch rows: default the smallest measured)."""
    try:
        results = json.loads(Path(path).read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MapBuildError(f"--calibration {path!r}: not a bench_head_gemm.py --json file ({e}).") from e
    at_tp = [r for r in results if r.get("tp") == tp]
    if not at_tp:
        raise MapBuildError(f"--calibration {path!r}: no measurement at tp={tp}; rerun it with --tp {tp}.")
    rows = rows if rows is not None else min(r["rows"] for r in at_tp)
    # The plain torch head GEMMs: stock shard, local and balanced hot heads (no packet, no Triton).
    not_gemm = ("packet", "triton", "+")
    gemms = [
        r
        for r in at_tp
        if r["rows"] == rows and r["head_rows"] > 0 and not any(w in r["variant"] for w in not_gemm)
    ]
    if len({r["head_rows"] for r in gemms}) < 2:
        raise MapBuildError(
            f"--calibration {path!r}: fewer than two head sizes measured at tp={tp}, rows={rows}."
        )
    x = torch.tensor([float(r["head_rows"]) for r in gemms], dtype=torch.float64)
    y = torch.tensor([float(r["median_us"]) for r in gemms], dtype=torch.float64)
    per_row = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    fixed = max(0.0, float(y.mean()) - per_row * float(x.mean()))
    return HeadCostModel(fixed, per_row, f"{path}: {fixed:.1f} us + {per_row * 1e3:.3f} ns/row at tp={tp}")


def estimate_sizes(
    counts: torch.Tensor,
    vocab_size: int,
    hidden: int,
    tp: int,
    sizes: list[int],
    *,
    accept_length: float,
    draft_steps: int,
    layout: str = "balanced",
    dtype_bytes: int = 2,
    head_share: float = DEFAULT_HEAD_SHARE,
    cost_model: HeadCostModel = HeadCostModel(),
    padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
) -> list[SizeEstimate]:
    """The model above for each size (ids ranked by count, ties: smaller id first)."""
    if counts.numel() > vocab_size:
        raise MapBuildError(
            f"counts over {counts.numel()} ids do not fit --vocab-size {vocab_size}: counted with another "
            "tokenizer?"
        )
    if not 0.0 <= head_share < 1.0:
        raise MapBuildError(f"--head-share {head_share}: must be in [0, 1).")
    total = int(counts.sum())
    if total == 0:
        raise MapBuildError("the counts hold no tokens.")
    alpha = acceptance_rate(accept_length, draft_steps)
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    cumulative = counts.to(torch.int64)[order].cumsum(0)
    full_columns = max(end - start for start, end in vocab_shard_ranges(vocab_size, tp, padding_size))
    full_cost = cost_model.cost(full_columns)
    estimates = []
    for size in sorted(set(sizes)):
        if not 0 < size <= counts.numel():
            raise MapBuildError(
                f"size {size}: must be between 1 and the counted id space ({counts.numel()})."
            )
        coverage = int(cumulative[size - 1]) / total
        plan = plan_hot_shards(order[:size], vocab_size, tp, padding_size=padding_size, layout=layout)
        head_cost = cost_model.cost(plan.width) / full_cost
        step_time = 1.0 - head_share * (1.0 - head_cost)
        accept = chain_accept_length(alpha * coverage, draft_steps)
        estimates.append(
            SizeEstimate(
                size=size,
                coverage=coverage,
                columns=plan.width,
                head_mib=plan.width * hidden * dtype_bytes / 2**20,
                head_cost=head_cost,
                step_time=step_time,
                accept_length=accept,
                speedup=accept / step_time / accept_length,
            )
        )
    return estimates


def recommend(estimates: list[SizeEstimate]) -> SizeEstimate:
    """The best modelled speed-up; the smaller size on a tie (within 0.1%)."""
    best = max(e.speedup for e in estimates)
    return min((e for e in estimates if e.speedup >= best * 0.999), key=lambda e: e.size)


def as_dicts(estimates: list[SizeEstimate]) -> list[dict]:
    return [asdict(e) for e in estimates]
