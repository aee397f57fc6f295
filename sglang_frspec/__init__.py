"""FR-Spec token maps for SGLang EAGLE under vocab-parallel tensor parallelism.

The pure core (plans, token maps, exchanges) imports torch only; the SGLang-facing drop-in
worker is imported lazily so ``import sglang_frspec`` stays cheap.
"""

from sglang_frspec.core import (
    HotShardPlan,
    TokenMapError,
    UnsupportedSetupError,
    plan_hot_shards,
    read_token_map,
)
from sglang_frspec.core.options import FrSpecOptions, set_options

__version__ = "0.1.0"
__all__ = [
    "FrSpecOptions",
    "HotShardPlan",
    "ShardedFRSpecEagleDraftWorker",
    "TokenMapError",
    "UnsupportedSetupError",
    "__version__",
    "plan_hot_shards",
    "read_token_map",
    "set_options",
]


def __getattr__(name: str):
    if name == "ShardedFRSpecEagleDraftWorker":
        from sglang_frspec.adapters.worker import ShardedFRSpecEagleDraftWorker

        return ShardedFRSpecEagleDraftWorker
    raise AttributeError(f"module 'sglang_frspec' has no attribute {name!r}")
