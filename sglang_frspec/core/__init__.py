"""Pure core: token maps, shard plans and hot-logit exchanges. Imports torch only, never SGLang."""

from sglang_frspec.core.errors import TokenMapError, UnsupportedSetupError
from sglang_frspec.core.gather import EXCHANGES, HotLogitsExchange, build_head_from_table, build_local_head
from sglang_frspec.core.plan import (
    LAYOUTS,
    HotShardPlan,
    plan_from_ranges,
    plan_hot_shards,
    table_slice_ranges,
    vocab_shard_ranges,
)
from sglang_frspec.core.token_map import (
    HotIds,
    HotWireOrder,
    canonical_hot_ids,
    check_hot_ids_cover_topk,
    ids_from_object,
    read_token_map,
)

__all__ = [
    "EXCHANGES",
    "LAYOUTS",
    "HotIds",
    "HotLogitsExchange",
    "HotShardPlan",
    "HotWireOrder",
    "TokenMapError",
    "UnsupportedSetupError",
    "build_head_from_table",
    "build_local_head",
    "canonical_hot_ids",
    "check_hot_ids_cover_topk",
    "ids_from_object",
    "plan_from_ranges",
    "plan_hot_shards",
    "read_token_map",
    "table_slice_ranges",
    "vocab_shard_ranges",
]
