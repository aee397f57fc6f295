"""Tokenizers and model configs for map building: loading, id space, EOS ids, named tokens, vocab size."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from sglang_frspec.core import UnsupportedSetupError
from sglang_frspec.maps.errors import MapBuildError


def _names_a_local_path(path: str) -> bool:
    # Hub ids look like "owner/name"; anything else that does not exist is a mistyped path.
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") >= 2


def load_tokenizer(path: str):
    """``transformers.AutoTokenizer.from_pretrained(path)``, with a clear error when it fails."""
    from transformers import AutoTokenizer

    if not os.path.exists(path) and _names_a_local_path(path):
        raise MapBuildError(f"tokenizer {path!r}: no such directory. Pass the model's directory.")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for bad folders
        raise MapBuildError(
            f"tokenizer {path!r}: cannot be loaded with transformers.AutoTokenizer.from_pretrained "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass a directory "
            "with the model's tokenizer files (tokenizer.json or tokenizer_config.json ...)."
        ) from e


def token_id_space(tokenizer) -> int:
    """One past the largest id the tokenizer can produce (added tokens included)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def vocab_id_space(tokenizer) -> int:
    """The ids of the tokenizer's vocab without the tokens added past it: what a model's vocab must hold.

    Added tokens may lie past the model's vocab: Gemma 3's tokenizer adds ``<image_soft_token>`` at
    id 262144 to its text models of 262144 ids, which never read or emit it.
    """
    return min(token_id_space(tokenizer), tokenizer.vocab_size)


def eos_token_ids(tokenizer, path: str) -> tuple[int, ...]:
    """The tokenizer's EOS id plus those in a ``generation_config.json`` beside it (chat models list more)."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    generation_config = Path(path) / "generation_config.json"
    if generation_config.is_file():
        configured = json.loads(generation_config.read_text()).get("eos_token_id")
        if configured is not None:
            ids.update(configured if isinstance(configured, list) else [configured])
    return tuple(sorted(ids))


def names_an_id(name: str | int) -> bool:
    """True for a token named by its id: an int, or a string of ASCII digits."""
    return isinstance(name, int) or (name.isascii() and name.isdigit())


def resolve_tokens(
    names: Sequence[str | int], id_space: int, tokenizer=None, tokenizer_name: str = "the tokenizer"
) -> tuple[int, ...]:
    """Ids of tokens named by id (an int or a string of digits) or by token string (needs the tokenizer)."""
    ids = []
    for name in names:
        if names_an_id(name):
            token_id = int(name)
            if not 0 <= token_id < id_space:
                raise MapBuildError(
                    f"include token {name!r}: id outside the tokenizer's ids [0, {id_space})."
                )
        elif tokenizer is None:
            raise MapBuildError(
                f"include token {name!r}: a token string needs the tokenizer; pass --tokenizer "
                "(or name the token by its id)."
            )
        else:
            token_id = tokenizer.convert_tokens_to_ids(name)
            if token_id is None or (token_id == tokenizer.unk_token_id and name != tokenizer.unk_token):
                raise MapBuildError(
                    f"include token {name!r}: {tokenizer_name} has no such token. Name it as it is "
                    "spelled in the vocab (tokenizer.convert_ids_to_tokens shows the spelling, e.g. "
                    "'Ġthe' for byte-level BPE) or by its id."
                )
        ids.append(int(token_id))
    return tuple(ids)


def vocab_size_of(model_path: str) -> int:
    """The original vocab size in a local model's config (text config for multimodal models)."""
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(model_path).get_text_config().vocab_size)
    except (OSError, ValueError, AttributeError) as e:  # missing folder, no/odd config.json
        raise UnsupportedSetupError(
            f"model {model_path!r}: cannot read its vocab size with transformers.AutoConfig "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass the model's "
            "directory (with config.json) or --vocab-size."
        ) from e
