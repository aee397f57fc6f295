"""``sglang-frspec build-map``: a token map from token counts over a corpus (FR-Spec's recipe) or
over what a running SGLang server generates for a set of prompts."""

from __future__ import annotations

import argparse
import os
import sys

from sglang_frspec.maps import (
    CORPUS_SUFFIXES,
    MapBuildError,
    TokenCounts,
    build_token_map,
    rebuild_token_map,
    save_token_map,
)
from sglang_frspec.maps.server_counts import build_token_map_from_server

# Options of one source only: (flag, argparse dest, the source it belongs to).
_SOURCE_OPTIONS = [
    ("--text-field", "text_field", ("corpus", "from_server")),
    ("--workers", "workers", ("corpus",)),
    ("--max-tokens", "max_tokens", ("corpus",)),
    ("--prompts", "prompts", ("from_server",)),
    ("--vocab-size", "vocab_size", ("from_server",)),
    ("--max-new-tokens", "max_new_tokens", ("from_server",)),
    ("--temperature", "temperature", ("from_server",)),
    ("--concurrency", "concurrency", ("from_server",)),
    ("--count-prompts", "count_prompts", ("from_server",)),
    ("--save-every", "save_every", ("from_server",)),
]
_SOURCE_FLAGS = {"corpus": "--corpus", "from_server": "--from-server"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "build-map",
        help="build a token map: the N most frequent token ids over a corpus, a server's outputs or "
        "saved counts",
        description="Count how often each token id occurs over a corpus (or in what a running SGLang "
        "server generates for a set of prompts, --from-server) and save the N most frequent "
        "(ties: smaller id first), most frequent first, as a 1-D int64 tensor for "
        "--speculative-token-map. The tokenizer's EOS ids (and those in generation_config.json) and "
        "the --include tokens are always kept. The full counts are saved too, so maps of other sizes "
        "can be made with --from-counts without counting again, and `inspect` can report coverage.",
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
    source.add_argument(
        "--from-server",
        metavar="URL",
        help="count the token ids a running SGLang server (e.g. http://127.0.0.1:30000) generates "
        "for the --prompts, through its native POST /generate",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="model or tokenizer directory (AutoTokenizer); required with --corpus; with --from-counts "
        "only for --include token strings (default: the one the counts were made with); with "
        "--from-server for the EOS ids and --include strings (default: the server's tokenizer, if its "
        "path is a directory here)",
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
        "--text-field",
        metavar="FIELD",
        help="JSON Lines / dataset field with the text or prompt (default: text)",
    )
    p.add_argument("--workers", type=int, metavar="K", help="--corpus: tokenizing processes (default: 1)")
    p.add_argument("--max-tokens", type=int, metavar="M", help="--corpus: stop after counting M tokens")
    server = p.add_argument_group("--from-server options")
    server.add_argument(
        "--prompts",
        metavar="FILE",
        help="the prompts: a JSON Lines file (.jsonl, .json; the --text-field of each line) or a text "
        "file, one prompt per line (empty prompts skipped); required with --from-server",
    )
    server.add_argument(
        "--vocab-size",
        type=int,
        metavar="V",
        help="the served model's vocab_size (default: read from its config.json when the server's "
        "model path is a directory here; checked against it when both are known)",
    )
    server.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="tokens generated per prompt (default: 256)"
    )
    server.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature (default: 0, greedy)"
    )
    server.add_argument("--concurrency", type=int, metavar="K", help="requests in flight (default: 8)")
    server.add_argument(
        "--count-prompts",
        action="store_true",
        default=None,
        help="also count the prompt ids (as the server tokenized them) besides the generated ones",
    )
    server.add_argument(
        "--save-every",
        type=int,
        metavar="K",
        help="save the counts every K answered prompts (default: 100; also on errors and Ctrl-C); a "
        "rerun with the same counts file sends only the prompts not counted yet",
    )
    p.add_argument("--save-counts", metavar="FILE", help="where to save the counts (default: MAP.counts.pt)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def check_source_options(args: argparse.Namespace) -> None:
    """Refuse options given for another source than the one chosen."""
    source = next(name for name in ("corpus", "from_counts", "from_server") if getattr(args, name))
    misplaced: dict[tuple[str, ...], list[str]] = {}
    for flag, dest, sources in _SOURCE_OPTIONS:
        if getattr(args, dest) is not None and source not in sources:
            misplaced.setdefault(sources, []).append(flag)
    if misplaced:
        raise MapBuildError(
            "; ".join(
                f"{', '.join(flags)}: only apply to counting a {' or '.join(map(_SOURCE_FLAGS.get, sources))}"
                for sources, flags in misplaced.items()
            )
            + "."
        )
    if source == "from_server" and not args.prompts:
        raise MapBuildError("--from-server needs --prompts (a JSON Lines or text file of prompts).")


def run(args: argparse.Namespace) -> int:
    check_source_options(args)
    counts_path = args.save_counts or f"{args.output}.counts.pt"
    if args.from_server:
        return run_from_server(args, counts_path)
    if args.from_counts:
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


def run_from_server(args: argparse.Namespace, counts_path: str) -> int:
    try:
        ids, counts = build_token_map_from_server(
            args.from_server,
            args.prompts,
            args.size,
            counts_path,
            vocab_size=args.vocab_size,
            tokenizer_path=args.tokenizer,
            include=args.include,
            text_field=args.text_field or "text",
            max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
            temperature=0.0 if args.temperature is None else args.temperature,
            concurrency=8 if args.concurrency is None else args.concurrency,
            count_prompts=bool(args.count_prompts),
            save_every=100 if args.save_every is None else args.save_every,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        return 130  # the counts so far are saved (the count said where); the same command resumes
    save_token_map(ids, args.output)
    if counts.tokenizer is None:
        print(
            "warning: no tokenizer (the server's tokenizer path is not a directory here and no "
            "--tokenizer), so the map keeps EOS only if it was generated often enough; pass "
            "--tokenizer or --include the EOS ids.",
            file=sys.stderr,
        )
    what = "generated and prompt" if counts.server["count_prompts"] else "generated"
    print(
        f"counts: {counts.num_tokens:,} {what} tokens for {counts.num_documents:,} prompts from "
        f"{counts.server['url']} (model {counts.server['model_path']}), saved to {counts_path}"
    )
    print(
        f"map: {ids.numel():,} hot ids (most frequent first; EOS {list(counts.eos_token_ids)} and "
        f"--include tokens kept) covering {counts.coverage(ids):.2%} of the counted tokens, "
        f"saved to {args.output}"
    )
    return 0
