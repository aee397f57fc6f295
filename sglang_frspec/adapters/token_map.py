"""Token-map sources SGLang accepts: a local file, or a hub ``repo_id/file`` path."""

from __future__ import annotations

import os

import torch

from sglang_frspec.core import TokenMapError, ids_from_object, read_token_map


def _looks_like_hub_path(path: str) -> bool:
    return not os.path.isabs(path) and not path.startswith(".") and path.count("/") >= 2


def load_token_map_ids(path: str) -> torch.Tensor:
    """Hot ids in file order from a local file or, like SGLang, a hub ``owner/repo/file``."""
    if os.path.exists(path) or not _looks_like_hub_path(path):
        return read_token_map(path)
    from sglang.srt.speculative.spec_utils import load_token_map

    try:
        # SGLang's own loader downloads the file (HF or ModelScope) and returns int64 ids.
        return ids_from_object(load_token_map(path), source=path)
    except TokenMapError:
        raise
    except Exception as e:
        raise TokenMapError(
            f"token map {path!r}: not a local file, and fetching it as a hub 'repo_id/file' "
            f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass "
            "the path of a local map file (or make the hub reachable)."
        ) from e
