"""Token-map tooling: count tokens over a corpus, rank them into a map, inspect and plot maps.

Names are imported from their modules on first use (PEP 562), so a serving scheduler that writes
a counts file (``maps.counts_file``) imports neither the counting pool nor the tokenizer module;
heavier libraries (transformers, datasets, tqdm, matplotlib) are imported only when used.
"""

import importlib

_MODULE_OF = {
    "build_token_map": "build",
    "rebuild_token_map": "build",
    "CORPUS_SUFFIXES": "corpus",
    "corpus_sources": "corpus",
    "read_documents": "corpus",
    "count_tokens": "counting",
    "encode_batch": "counting",
    "TokenCounts": "counts_file",
    "MapBuildError": "errors",
    "plot_plans": "plot",
    "check_map_size": "ranking",
    "save_token_map": "ranking",
    "top_token_ids": "ranking",
    "eos_token_ids": "tokenizer",
    "load_tokenizer": "tokenizer",
    "resolve_tokens": "tokenizer",
    "token_id_space": "tokenizer",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
