"""Option blocks shared by the subcommands that read a map against a target's vocab."""

from __future__ import annotations

import argparse

from sglang_frspec.core.plan import DEFAULT_VOCAB_PADDING_SIZE
from sglang_frspec.maps.tokenizer import vocab_size_of


def add_vocab_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """``--vocab-size V`` or ``--model-path M`` (read from its config.json), one of the two."""
    vocab = parser.add_mutually_exclusive_group(required=required)
    vocab.add_argument("--vocab-size", type=int, help="target vocab size (config.vocab_size)")
    vocab.add_argument("--model-path", help="read the vocab size from this model's config.json")


def vocab_size_from(args: argparse.Namespace) -> int | None:
    """The vocab size the options give (None when neither was given)."""
    if args.vocab_size is not None:
        return args.vocab_size
    return vocab_size_of(args.model_path) if args.model_path else None


def add_padding_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--padding-size",
        type=int,
        default=DEFAULT_VOCAB_PADDING_SIZE,
        help="vocab padding unit of the target head (SGLang default: 64)",
    )
