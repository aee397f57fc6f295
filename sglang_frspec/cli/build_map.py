"""``sglang-frspec build-map``: a token map from token counts over a corpus (FR-Spec's recipe)."""

from __future__ import annotations

import argparse
import os

from sglang_frspec.maps import (
    CORPUS_SUFFIXES,
    MapBuildError,
    TokenCounts,
    build_token_map,
    rebuild_token_map,
    save_token_map,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "build-map",
        help="build a token map: the N most frequent token ids over a corpus (or saved counts)",
        description="Count how often each token id occurs over a corpus and save the N most frequent "
        "(ties: smaller id first), most frequent first, as a 1-D int64 tensor for "
        "--speculative-token-map. The tokenizer's EOS ids (and those in generation_config.json) and "
        "the --include tokens are always kept. The full counts are saved too, so maps of other sizes "
        "can be made with --from-counts without tokenizing again, and `inspect` can report coverage.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE_OR_DIR",
        help=f"text files (one document per line), JSON Lines files ({', '.join(CORPUS_SUFFIXES[1:])}), "
        "datasets saved with save_to_disk, or directories holding them (walked in sorted order, "
        f"{', '.join(CORPUS_SUFFIXES)} files)",
    )
    source.add_argument("--from-counts", metavar="FILE", help="rank the counts saved by an earlier build")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="model or tokenizer directory (AutoTokenizer); required with --corpus, with --from-counts "
        "only for --include token strings (default: the one the counts were made with)",
    )
    p.add_argument("--size", type=int, required=True, metavar="N", help="hot ids to keep (FR-Spec: 32768)")
    p.add_argument("-o", "--output", required=True, metavar="MAP", help="token-map file to write (.pt)")
    p.add_argument(
        "--include",
        nargs="+",
        default=[],
        metavar="TOKEN",
        help="tokens the map must hold besides EOS: token strings as spelled in the vocab, or ids",
    )
    p.add_argument(
        "--text-field", metavar="FIELD", help="JSON Lines / dataset field with the text (default: text)"
    )
    p.add_argument("--workers", type=int, metavar="K", help="tokenizing processes (default: 1)")
    p.add_argument("--max-tokens", type=int, metavar="M", help="stop after counting M tokens")
    p.add_argument("--save-counts", metavar="FILE", help="where to save the counts (default: MAP.counts.pt)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    counts_path = args.save_counts or f"{args.output}.counts.pt"
    if args.from_counts:
        corpus_only = [
            flag
            for flag, value in (
                ("--text-field", args.text_field),
                ("--workers", args.workers),
                ("--max-tokens", args.max_tokens),
            )
            if value is not None
        ]
        if corpus_only:
            raise MapBuildError(f"{', '.join(corpus_only)}: only apply to counting a --corpus.")
        counts = TokenCounts.load(args.from_counts)
        ids = rebuild_token_map(counts, args.size, include=args.include, tokenizer_path=args.tokenizer)
    else:
        if not args.tokenizer:
            raise MapBuildError("--corpus needs --tokenizer (the target model's directory).")
        ids, counts = build_token_map(
            args.tokenizer,
            args.corpus,
            args.size,
            include=args.include,
            text_field=args.text_field or "text",
            workers=1 if args.workers is None else args.workers,
            max_tokens=args.max_tokens,
            progress=not args.no_progress,
        )
    save_token_map(ids, args.output)
    # A copy next to a map rebuilt from counts lets `inspect` find them there as well.
    rewriting_source = (
        args.from_counts and os.path.exists(counts_path) and os.path.samefile(counts_path, args.from_counts)
    )
    if not rewriting_source:
        counts.save(counts_path)
    print(
        f"counts: {counts.num_tokens:,} tokens in {counts.num_documents:,} documents "
        f"(tokenizer {counts.tokenizer}), saved to {counts_path}"
    )
    print(
        f"map: {ids.numel():,} hot ids (most frequent first; EOS {list(counts.eos_token_ids)} and "
        f"--include tokens kept) covering {counts.coverage(ids):.2%} of the counted tokens, "
        f"saved to {args.output}"
    )
    return 0
