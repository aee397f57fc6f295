"""``sglang-frspec inspect``: what a token map holds, whether it fits a model, what it covers, its TP plan."""

from __future__ import annotations

import argparse
import json
import os

import torch

from sglang_frspec.adapters.token_map import load_token_map_ids
from sglang_frspec.cli.common import add_padding_option, add_vocab_options, vocab_size_from
from sglang_frspec.cli.plan import format_table
from sglang_frspec.core import LAYOUTS, UnsupportedSetupError, plan_hot_shards
from sglang_frspec.maps import TokenCounts


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="size, id range, duplicates, fit to a model's vocab, corpus coverage and TP plan of a map",
        description="Report on a token map: number of ids, id range and duplicates; with --model-path "
        "(or --vocab-size), whether every id fits the model's vocab (exit status 1 if not); with "
        "counts (--counts, or MAP.counts.pt next to the map), the fraction of the counted corpus "
        "tokens the map covers and the best coverage maps of other sizes could reach; with --tp, "
        "the per-rank plan for each layout.",
    )
    p.add_argument(
        "token_map", metavar="MAP", help="token-map file (.pt tensor or list), or hub owner/repo/file"
    )
    add_vocab_options(p, required=False)
    p.add_argument("--tp", type=int, help="show the plan over this many ranks (needs the vocab size)")
    add_padding_option(p)
    p.add_argument("--counts", metavar="FILE", help="counts file from build-map (default: MAP.counts.pt)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def coverage_sizes(map_size: int, id_space: int) -> list[int]:
    """Map sizes worth comparing: powers of two from 1/64 of the id space up, and the map's own."""
    sizes = {map_size}
    n = 1 << max(0, (id_space // 64).bit_length() - 1)
    while n < id_space:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


def inspect_map(args: argparse.Namespace) -> dict:
    ids = load_token_map_ids(args.token_map)
    report: dict = {
        "token_map": args.token_map,
        "num_ids": int(ids.numel()),
        "num_unique": int(torch.unique(ids).numel()),
        "num_duplicates": int(ids.numel() - torch.unique(ids).numel()),
        "min_id": int(ids.min()),
        "max_id": int(ids.max()),
    }
    vocab = vocab_size_from(args)
    if args.tp and vocab is None:
        raise UnsupportedSetupError("--tp needs the target's vocab size: add --model-path or --vocab-size.")
    if vocab is not None:
        outside = ids[(ids < 0) | (ids >= vocab)]
        report |= {
            "vocab_size": vocab,
            "fits_vocab": not outside.numel(),
            "ids_outside_vocab": sorted(set(outside.tolist()))[:10],
        }
    counts_path = args.counts or f"{args.token_map}.counts.pt"
    if args.counts or os.path.isfile(counts_path):
        counts = TokenCounts.load(counts_path)
        report["counts"] = {
            "file": counts_path,
            "tokenizer": counts.tokenizer,
            "num_tokens": counts.num_tokens,
            "num_documents": counts.num_documents,
            "coverage": counts.coverage(ids),
            "best_coverage_by_size": counts.best_coverage(
                coverage_sizes(report["num_unique"], counts.id_space)
            ),
        }
    if args.tp and report["fits_vocab"]:
        report["plans"] = [
            plan_hot_shards(ids, vocab, args.tp, padding_size=args.padding_size, layout=layout)
            for layout in LAYOUTS
        ]
    return report


def format_report(report: dict) -> str:
    lines = [
        f"token map {report['token_map']}",
        f"  ids        {report['num_ids']:,} ({report['num_unique']:,} unique, "
        f"{report['num_duplicates']:,} duplicates), range [{report['min_id']}, {report['max_id']}]",
    ]
    if "vocab_size" in report:
        fit = (
            "every id fits"
            if report["fits_vocab"]
            else f"does NOT fit: ids outside [0, {report['vocab_size']}): {report['ids_outside_vocab']}"
        )
        lines.append(f"  vocab      {report['vocab_size']:,}: {fit}")
    if "counts" in report:
        counts = report["counts"]
        lines.append(
            f"  coverage   {counts['coverage']:.2%} of {counts['num_tokens']:,} counted tokens in "
            f"{counts['num_documents']:,} documents ({counts['file']})"
        )
        lines.append("  best coverage of an N-id map over the same counts:")
        lines.extend(
            f"    N={size:>8,}  {coverage:7.2%}{'  <- this map' * (size == report['num_unique'])}"
            for size, coverage in counts["best_coverage_by_size"].items()
        )
    for plan in report.get("plans", []):
        lines.extend(["", format_table(plan, dtype_bytes=2, k=4)])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = inspect_map(args)
    if args.json:
        report["plans"] = [plan.describe(itemsize=2) for plan in report.get("plans", [])]
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report.get("fits_vocab", True) else 1
