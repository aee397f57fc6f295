"""Token-map tooling: count tokens over a corpus, rank them into a map, inspect and plot maps.

Heavier libraries (transformers, datasets, tqdm, matplotlib) are imported only when used.
"""

from sglang_frspec.maps.build import build_token_map, rebuild_token_map
from sglang_frspec.maps.corpus import CORPUS_SUFFIXES, corpus_sources, read_documents
from sglang_frspec.maps.counting import TokenCounts, count_tokens, encode_batch
from sglang_frspec.maps.errors import MapBuildError
from sglang_frspec.maps.plot import plot_plans
from sglang_frspec.maps.ranking import check_map_size, save_token_map, top_token_ids
from sglang_frspec.maps.tokenizer import eos_token_ids, load_tokenizer, resolve_tokens, token_id_space

__all__ = [
    "CORPUS_SUFFIXES",
    "MapBuildError",
    "TokenCounts",
    "build_token_map",
    "check_map_size",
    "corpus_sources",
    "count_tokens",
    "encode_batch",
    "eos_token_ids",
    "load_tokenizer",
    "plot_plans",
    "read_documents",
    "rebuild_token_map",
    "resolve_tokens",
    "save_token_map",
    "token_id_space",
    "top_token_ids",
]
