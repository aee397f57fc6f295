"""``sglang-frspec size``: coverage and modelled speed of each map size, and the one to use."""

from __future__ import annotations

import argparse
import json

from sglang_frspec.cli.common import add_vocab_options, vocab_size_from
from sglang_frspec.cli.inspect_map import coverage_sizes
from sglang_frspec.core import LAYOUTS, canonical_hot_ids, read_token_map
from sglang_frspec.core.plan import DEFAULT_VOCAB_PADDING_SIZE
from sglang_frspec.maps import TokenCounts
from sglang_frspec.maps.errors import MapBuildError
from sglang_frspec.maps.sizing import (
    DEFAULT_HEAD_SHARE,
    HeadCostModel,
    SizeEstimate,
    as_dicts,
    calibrated_cost_model,
    estimate_sizes,
    recommend,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "size",
        help="coverage curve, head cost and modelled speed-up per map size; recommends one",
        description="For each map size N (the N most frequent ids of a counts file from build-map or "
        "from serving with SGLANG_FRSPEC_COUNTS): the share of counted tokens it covers, the draft-head "
        "rows and bytes on the slowest rank (from the TP plan), and a modelled accept length and "
        "speed-up over EAGLE without a map. The model (see docs/token-maps.md): per-token acceptance "
        "scales with the share of accepted drafts the map keeps (measured in serving counts; taken as "
        "the coverage for other counts, which is pessimistic for small maps); the head's share of a "
        "speculative step (--head-share) shrinks with the plan's width. The size with the best "
        "modelled speed-up is recommended.",
    )
    p.add_argument("--counts", required=True, metavar="FILE", help="counts file (build-map or serving)")
    add_vocab_options(p, required=True)
    p.add_argument("--hidden", type=int, required=True, help="hidden size of the draft head")
    p.add_argument("--tp", type=int, required=True, help="size of the group sharding the target head")
    p.add_argument("--layout", choices=LAYOUTS, default="balanced")
    p.add_argument("--sizes", type=int, nargs="+", help="sizes to compare (default: powers of two and V)")
    p.add_argument(
        "--map",
        nargs="+",
        default=[],
        metavar="FILE",
        help="also model these token-map files (e.g. the one you serve) on the same counts",
    )
    p.add_argument(
        "--accept-length",
        type=float,
        help="spec_accept_length measured without a map, or with the map that serving counts were "
        "served with (default: serving counts' own; else 3.0: replace with yours)",
    )
    p.add_argument(
        "--draft-steps",
        type=int,
        help="--speculative-num-steps of that measurement (default: serving counts' own; else 3)",
    )
    p.add_argument(
        "--head-share",
        type=float,
        default=DEFAULT_HEAD_SHARE,
        help=f"share of a speculative step spent in the draft LM head without a map (default "
        f"{DEFAULT_HEAD_SHARE}: FR-Spec's 1.12x for Llama-3-8B at 32k ids)",
    )
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per head weight (2 for bf16/fp16)")
    p.add_argument(
        "--calibration",
        metavar="JSON",
        help="bench_head_gemm.py --json output: fit head time as fixed + per-row cost at this --tp",
    )
    p.add_argument(
        "--padding-size",
        type=int,
        default=DEFAULT_VOCAB_PADDING_SIZE,
        help="vocab padding unit of the target head (SGLang default: 64)",
    )
    p.add_argument("--plot", metavar="PNG", help="save coverage and modelled speed-up against size")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def format_report(estimates: list[SizeEstimate], best: SizeEstimate, header: str, kept: bool) -> str:
    """The table; ``kept``: with the drafts-kept column (counts with accepted drafts)."""
    lines = [
        header,
        f"{'size':>8} {'coverage':>9}{' drafts kept' if kept else ''} {'columns':>8} {'head MiB':>9} "
        f"{'head cost':>9} {'step time':>9} {'accept':>6} {'speed-up':>8}",
    ]
    for e in estimates:
        mark = "  <- recommended" if e is best else f"  {e.token_map}" if e.token_map else ""
        lines.append(
            f"{e.size:>8} {e.coverage:>8.2%}{f' {e.drafts_kept:>11.2%}' if kept else ''} {e.columns:>8} "
            f"{e.head_mib:>9.2f} {e.head_cost:>9.3f} {e.step_time:>9.3f} {e.accept_length:>6.2f} "
            f"{e.speedup:>7.3f}x{mark}"
        )
    lines.append(
        f"recommended: {best.size} ids: covers {best.coverage:.2%} of the counted tokens (loses "
        f"{1 - best.coverage:.2%}), head {1 - best.head_cost:.1%} cheaper on the slowest rank, speculative "
        f"step {1 - best.step_time:.1%} shorter, modelled speed-up {best.speedup:.3f}x over no map"
    )
    return "\n".join(lines)


def plot(estimates: list[SizeEstimate], best: SizeEstimate, path: str) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MapBuildError("--plot needs matplotlib: pip install matplotlib") from e
    figure = Figure(figsize=(7.5, 4.5), layout="constrained")
    axes = figure.subplots()
    estimates = [e for e in estimates if e.token_map is None]  # the curves are over sizes
    sizes = [e.size for e in estimates]
    axes.plot(sizes, [e.coverage for e in estimates], "-o", label="coverage of counted tokens")
    axes.plot(
        sizes, [e.head_cost for e in estimates], "-s", label="draft-head cost (slowest rank, vs no map)"
    )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("map size (hot ids)")
    axes.set_ylabel("fraction")
    speed = axes.twinx()
    speed.plot(sizes, [e.speedup for e in estimates], "-^", color="tab:green", label="modelled speed-up")
    speed.set_ylabel("modelled speed-up over no map")
    axes.axvline(best.size, color="grey", linestyle="--", linewidth=1)
    handles = axes.get_legend_handles_labels()[0] + speed.get_legend_handles_labels()[0]
    axes.legend(handles=handles, fontsize=8, loc="center right")
    axes.set_title(f"recommended: {best.size} ids", fontsize=10)
    figure.savefig(path, dpi=120)


def has_accepted_drafts(counts: TokenCounts) -> bool:
    return counts.accepted is not None and bool(counts.accepted.sum())


def acceptance_source(counts: TokenCounts, kept: bool) -> str:
    """Where the modelled acceptance comes from (``kept``: from accepted drafts), for the header."""
    if not kept:
        return "acceptance scaled by coverage (counts without accepted drafts: pessimistic for small maps)"
    served = counts.speculative or {}
    return (
        f"acceptance scaled by the accepted drafts kept ({int(counts.accepted.sum()):,} counted, served "
        f"with a {served.get('hot_ids', '?')}-id map, topk {served.get('topk', '?')})"
    )


def run(args: argparse.Namespace) -> int:
    counts = TokenCounts.load(args.counts)
    vocab_size = vocab_size_from(args)
    cost_model = calibrated_cost_model(args.calibration, args.tp) if args.calibration else HeadCostModel()
    served = counts.speculative or {}
    kept = has_accepted_drafts(counts)
    accept_length = args.accept_length or served.get("accept_length") or 3.0
    draft_steps = args.draft_steps or served.get("num_steps") or 3
    token_maps = {path: canonical_hot_ids(read_token_map(path), vocab_size, path).ids for path in args.map}
    estimates = estimate_sizes(
        counts.counts,
        vocab_size,
        args.hidden,
        args.tp,
        args.sizes or coverage_sizes(min(counts.id_space, vocab_size), min(counts.id_space, vocab_size)),
        accept_length=accept_length,
        draft_steps=draft_steps,
        accepted=counts.accepted,
        token_maps=token_maps,
        layout=args.layout,
        dtype_bytes=args.dtype_bytes,
        head_share=args.head_share,
        cost_model=cost_model,
        padding_size=args.padding_size,
    )
    best = recommend(estimates)
    if args.plot:
        plot(estimates, best, args.plot)
    if args.json:
        print(
            json.dumps(
                {
                    "recommended": best.size,
                    "cost_model": cost_model.source,
                    "accept_length": accept_length,
                    "draft_steps": draft_steps,
                    "acceptance": acceptance_source(counts, kept),
                    "sizes": as_dicts(estimates),
                }
            )
        )
        return 0
    header = (
        f"counts {args.counts}: {counts.num_tokens:,} tokens; vocab {vocab_size}, hidden {args.hidden}, "
        f"tp {args.tp} ({args.layout}); accept length {accept_length:.3g} over {draft_steps} steps; "
        f"{acceptance_source(counts, kept)}; head share {args.head_share}; head cost: {cost_model.source}"
    )
    print(format_report(estimates, best, header, kept=kept))
    return 0
