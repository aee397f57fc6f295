"""Choosing a map size: coverage from counts, head cost from the plan, and a speed model joining them.

The model, per candidate map (the N most frequent counted ids, or a given map file):
- coverage c: the share of counted tokens inside the map.
- drafts kept k: the share of the drafts the target accepts that the map still lets the draft
  propose. A draft with a map proposes only its ids, so an accepted draft outside it is lost; the
  per-token acceptance is ``alpha_map = alpha * k``, where ``alpha`` is solved from a measured
  accept length L of chain drafting with k steps: ``L = (1 - alpha^(steps+1)) / (1 - alpha)``.
  Serving counts (``SGLANG_FRSPEC_COUNTS``) hold the accepted drafts per id, so k is measured;
  it is relative to the map they were served with (ids outside it were never proposed), and L is
  that server's accept length. Other counts (a corpus, ``build-map --from-server``) do not, and k
  is taken as c: as if the draft were as often right on a cold token as on a hot one. That is
  pessimistic for small maps: the tokens a small map drops are rare ones the draft mostly misses
  anyway, and most of them are bonus tokens the target commits after a rejected draft.
- head cost h: the slowest rank's draft-head work relative to the full-vocab shard, from the
  shard plan's width (columns per rank); linear in the rows streamed, or ``a + b * rows`` fitted to
  ``bench_head_gemm.py`` timings (the fixed part ``a`` makes small maps save less).
- step time ``T = 1 - s * (1 - h)`` relative to EAGLE without a map, where s is the share of
  a speculative step (draft + verify) spent in the draft LM head without a map.
- modelled speed-up over no map: ``(L_map / T) / L``.
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
    drafts_kept: float  # the k above: measured from accepted-draft counts, else the coverage
    columns: int  # head rows on the slowest rank
    head_mib: float  # those rows' bytes per rank
    head_cost: float  # relative to the full-vocab shard
    step_time: float  # relative to a speculative step without a map
    accept_length: float
    speedup: float  # modelled tokens/s vs EAGLE without a map
    token_map: str | None = None  # the map file, for a given map (else the top ``size`` counted ids)


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
    accepted: torch.Tensor | None = None,
    token_maps: dict[str, torch.Tensor] | None = None,
    layout: str = "balanced",
    dtype_bytes: int = 2,
    head_share: float = DEFAULT_HEAD_SHARE,
    cost_model: HeadCostModel = HeadCostModel(),
    padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
) -> list[SizeEstimate]:
    """The model above for each size (ids ranked by count, ties: smaller id first), then for each
    given map (name: hot ids). ``accepted``: accepted drafts per id, from serving counts."""
    if counts.numel() > vocab_size:
        past = vocab_size + torch.nonzero(counts[vocab_size:]).flatten()
        if past.numel():
            raise MapBuildError(
                f"counts over {counts.numel()} ids do not fit --vocab-size {vocab_size}: counted with "
                f"another tokenizer? (ids {past[:10].tolist()} past it were counted)"
            )
        # Never counted: tokens a tokenizer adds past the model's vocab (Gemma 3's <image_soft_token>).
        counts = counts[:vocab_size]
        accepted = None if accepted is None else accepted[:vocab_size]
    if not 0.0 <= head_share < 1.0:
        raise MapBuildError(f"--head-share {head_share}: must be in [0, 1).")
    counts = counts.to(torch.int64)
    total = int(counts.sum())
    if total == 0:
        raise MapBuildError("the counts hold no tokens.")
    accepted_total = 0 if accepted is None or accepted.shape != counts.shape else int(accepted.sum())
    if accepted_total == 0:
        accepted = None  # no accepted drafts to measure k on (e.g. every step rejected its drafts)
    alpha = acceptance_rate(accept_length, draft_steps)
    order = torch.sort(counts, descending=True, stable=True).indices
    full_columns = max(end - start for start, end in vocab_shard_ranges(vocab_size, tp, padding_size))
    full_cost = cost_model.cost(full_columns)

    def estimate(ids: torch.Tensor, token_map: str | None) -> SizeEstimate:
        counted = ids[ids < counts.numel()]  # map ids past the counted id space were never counted
        coverage = int(counts[counted].sum()) / total
        kept = coverage if accepted is None else int(accepted[counted].sum()) / accepted_total
        plan = plan_hot_shards(ids, vocab_size, tp, padding_size=padding_size, layout=layout)
        head_cost = cost_model.cost(plan.width) / full_cost
        step_time = 1.0 - head_share * (1.0 - head_cost)
        accept = chain_accept_length(alpha * kept, draft_steps)
        return SizeEstimate(
            size=int(ids.numel()),
            coverage=coverage,
            drafts_kept=kept,
            columns=plan.width,
            head_mib=plan.width * hidden * dtype_bytes / 2**20,
            head_cost=head_cost,
            step_time=step_time,
            accept_length=accept,
            speedup=accept / step_time / accept_length,
            token_map=token_map,
        )

    estimates = []
    for size in sorted(set(sizes)):
        if not 0 < size <= counts.numel():
            raise MapBuildError(
                f"size {size}: must be between 1 and the counted id space ({counts.numel()})."
            )
        estimates.append(estimate(order[:size], None))
    for name, ids in (token_maps or {}).items():
        estimates.append(estimate(ids.to(torch.int64), name))
    return estimates


def recommend(estimates: list[SizeEstimate]) -> SizeEstimate:
    """The size with the best modelled speed-up; the smaller one on a tie (within 0.1%). Given maps
    are compared, not recommended, unless there is nothing else."""
    candidates = [e for e in estimates if e.token_map is None] or estimates
    best = max(e.speedup for e in candidates)
    return min((e for e in candidates if e.speedup >= best * 0.999), key=lambda e: e.size)


def as_dicts(estimates: list[SizeEstimate]) -> list[dict]:
    return [asdict(e) for e in estimates]
