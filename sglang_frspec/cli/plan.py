"""``sglang-frspec plan``: how a token map spreads over the ranks of a vocab-parallel head."""

from __future__ import annotations

import argparse
import json
import sys

from sglang_frspec.cli.common import add_padding_option, add_vocab_options, vocab_size_from
from sglang_frspec.core import LAYOUTS, HotShardPlan, plan_hot_shards
from sglang_frspec.core.dequant import HEAD_FORMAT_BITS, head_bytes
from sglang_frspec.core.exchange_rule import auto_exchange
from sglang_frspec.core.token_map import read_token_map


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-rank table of a token map under TP (vocab ranges, hot ids, width, bytes)",
        description="Show how a token map is split over the TP ranks of the target LM head, for "
        "each layout: vocab range per rank, hot ids it owns, columns it computes, the padded "
        "width, max/mean imbalance and the bytes gathered per logits row by each exchange.",
    )
    p.add_argument("--token-map", required=True, help="token-map file (.pt tensor or list)")
    add_vocab_options(p, required=True)
    p.add_argument("--tp", type=int, required=True, help="size of the group sharding the head")
    p.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    add_padding_option(p)
    p.add_argument(
        "--dtype-bytes", type=int, default=2, help="bytes per logit on the wire (2 for bf16/fp16, 4 for fp32)"
    )
    p.add_argument("--topk", type=int, default=4, help="k of the top-k exchange (EAGLE topk)")
    p.add_argument(
        "--rows", type=int, nargs="+", default=[1, 8, 64], help="batch sizes to show exchange=auto's pick for"
    )
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="device type the auto rule assumes"
    )
    p.add_argument(
        "--hidden", type=int, help="hidden size: also show the bytes a draft step reads of the head per rank"
    )
    p.add_argument(
        "--head-format",
        choices=list(HEAD_FORMAT_BITS),
        default="bf16",
        help="the target LM head's format, for --hidden (the plugin serves fp32/bf16/fp16 heads and "
        "ModelOpt fp8 ones, whose hot rows it dequantizes; bf16 is assumed for them)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--plot", metavar="PNG", help="also save a bar chart of the hot ids each rank computes, per layout"
    )
    p.set_defaults(func=run)


def make_plans(args: argparse.Namespace) -> list[HotShardPlan]:
    vocab = vocab_size_from(args)
    ids = read_token_map(args.token_map)
    layouts = LAYOUTS if args.layout == "all" else (args.layout,)
    return [
        plan_hot_shards(ids, vocab, args.tp, padding_size=args.padding_size, layout=layout)
        for layout in layouts
    ]


def auto_picks(plan: HotShardPlan, args: argparse.Namespace) -> dict[int, str]:
    """What ``SGLANG_FRSPEC_EXCHANGE=auto`` runs at each of ``args.rows``."""
    return {rows: auto_exchange(plan, rows, args.topk, args.dtype_bytes, args.device) for rows in args.rows}


def format_table(plan: HotShardPlan, dtype_bytes: int, k: int, picks: dict[int, str] | None = None) -> str:
    """The per-rank table of a plan; ``picks`` (rows -> exchange) adds what ``auto`` runs."""
    auto = (
        "; exchange auto runs " + ", ".join(f"{p} at {rows} row(s)" for rows, p in picks.items())
        if picks
        else ""
    )
    lines = [
        f"layout {plan.layout}: {plan.num_hot} hot ids over {plan.tp_size} rank(s), width "
        f"{plan.width}, max/mean {plan.imbalance:.2f}, gathered per logits row: "
        f"{plan.gathered_bytes_per_row(dtype_bytes):,} B (exchange full), "
        f"{plan.topk_bytes_per_row(k):,} B (exchange topk, k={k})" + auto,
        f"{'rank':>4}  {'vocab range':>19}  {'owned hot':>9}  {'columns':>7}  {'padding':>7}",
    ]
    for r in range(plan.tp_size):
        start, end = plan.shard_ranges[r]
        lines.append(
            f"{r:>4}  {f'[{start}, {end})':>19}  {plan.owned_counts[r]:>9}  "
            f"{plan.counts[r]:>7}  {plan.width - plan.counts[r]:>7}"
        )
    return "\n".join(lines)


def hot_head_format(head_format: str) -> str:
    """The hot head's format: a plain head's rows as they are, quantized rows dequantized (bf16)."""
    return head_format if HEAD_FORMAT_BITS[head_format] >= 16 else "bf16"


def head_bytes_per_rank(plan: HotShardPlan, hidden: int, head_format: str) -> dict[str, int]:
    """Bytes a draft step reads of the head on the busiest rank: the hot head against the
    target's full-vocab shard (its vocab rows, padding aside) in its own format."""
    shard_rows = max(end - start for start, end in plan.shard_ranges)
    return {
        "hot_head": head_bytes(plan.width, hidden, hot_head_format(head_format)),
        "vocab_shard": head_bytes(shard_rows, hidden, head_format),
    }


def format_head_bytes(head: dict[str, int], head_format: str) -> str:
    """One line: the hot head's bytes per rank against the full-vocab shard's."""
    more = head["hot_head"] > head["vocab_shard"]
    note = " (the hot head reads MORE: a smaller map reads less)" if more else ""
    return (
        f"head read per draft step and rank: {head['hot_head']:,} B of {hot_head_format(head_format)} "
        f"hot head instead of {head['vocab_shard']:,} B of the {head_format} vocab shard{note}"
    )


def run(args: argparse.Namespace) -> int:
    plans = make_plans(args)
    heads = [head_bytes_per_rank(p, args.hidden, args.head_format) if args.hidden else None for p in plans]
    if args.json:
        described = [
            {**p.describe(args.dtype_bytes, args.topk), "auto_exchange": auto_picks(p, args)}
            | ({"head_bytes_per_rank": head | {"head_format": args.head_format}} if head else {})
            for p, head in zip(plans, heads)
        ]
        print(json.dumps(described, indent=2))
    else:
        tables = [
            format_table(p, args.dtype_bytes, args.topk, auto_picks(p, args))
            + (f"\n{format_head_bytes(head, args.head_format)}" if head else "")
            for p, head in zip(plans, heads)
        ]
        print("\n\n".join(tables))
    if args.plot:
        from sglang_frspec.maps import plot_plans

        plot_plans(plans, args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)  # stderr: --json output stays pure JSON
    return 0
