"""Seam 4: server-argument resolution (main process, before any model or device work)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from sglang.srt.arg_groups.model_override_base import resolving_view

from sglang_frspec.adapters.contract import running_form
from sglang_frspec.adapters.hooks import ON_WORKER, hooked_targets
from sglang_frspec.adapters.pd import PD_MODES
from sglang_frspec.adapters.token_map import load_token_map_ids
from sglang_frspec.core import UnsupportedSetupError, canonical_hot_ids, check_hot_ids_cover_topk
from sglang_frspec.core.adapt import check_adaptation_setup
from sglang_frspec.core.options import FrSpecOptions

logger = logging.getLogger(__name__)

# The hooks without which stock SGLang crashes on a token map at TP > 1.
MAP_HOOKS = (
    *hooked_targets(f"{ON_WORKER}around_init_token_map"),
    *hooked_targets(f"{ON_WORKER}around_init_lm_head"),
)


# Resolved algorithms whose workers do not read --speculative-token-map (stock ignores it).
IGNORES_TOKEN_MAP = {
    None: "without --speculative-algorithm",
    "EAGLE3": "for EAGLE3: its draft ships its own reduced vocab (d2t), which already works under TP",
    "FROZEN_KV_MTP": "for FROZEN_KV_MTP (SGLang promotes EAGLE/NEXTN to it for Gemma-4 assistant "
    "drafts, which keep their own head)",
}


def _target_vocab_size(cfg) -> int | None:
    """The target's original vocab size from its HF config, or None if it cannot be read."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            cfg.model_path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision
        )
        return int(config.get_text_config().vocab_size)
    except Exception as e:  # exotic configs: the scheduler still checks against the real head
        logger.debug("sglang-frspec: cannot read the target vocab size at argument time: %s", e)
        return None


def _check_hooks_active() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in MAP_HOOKS if t not in HookRegistry._patched]
    if missing:
        raise UnsupportedSetupError(
            "sglang-frspec is loaded but its hook(s) on " + ", ".join(missing) + " are not "
            "active (SGLang logs 'Failed to apply hooks' with the reason). Without them "
            "stock SGLang crashes on --speculative-token-map at --tp-size > 1. Fix the "
            "logged error, or use sglang_frspec.ShardedFRSpecEagleDraftWorker directly."
        )


def check_speculative_args(server_args, previous: Callable) -> None:
    """Resolution hook on ``handle_speculative_decoding``: reject what cannot work, early."""
    previous(server_args)
    cfg = resolving_view(server_args)
    token_map = cfg.speculative_token_map
    if token_map is None:
        return
    algorithm = cfg.speculative_algorithm
    if algorithm in IGNORES_TOKEN_MAP:  # as stock: the map is not used there
        logger.warning("--speculative-token-map is ignored %s.", IGNORES_TOKEN_MAP[algorithm])
        return
    if algorithm != "EAGLE":
        reason = {
            "STANDALONE": "the standalone draft keeps its full-vocab head, so SGLang would "
            "apply the map to full-vocab logits (wrong at any TP)",
        }.get(algorithm, f"{algorithm} does not use a hot-token draft head")
        raise UnsupportedSetupError(
            f"--speculative-token-map works only with --speculative-algorithm EAGLE (or "
            f"NEXTN); {reason}. Drop --speculative-token-map or use an EAGLE draft."
        )
    if cfg.enable_multi_layer_eagle:
        raise UnsupportedSetupError(
            "--speculative-token-map cannot be combined with --enable-multi-layer-eagle: the "
            "multi-layer EAGLE worker shares the full head and would silently ignore the map. "
            "Drop one of the two flags."
        )
    if cfg.load_format == "gguf" or str(cfg.model_path).endswith(".gguf"):
        raise UnsupportedSetupError(
            "--speculative-token-map cannot be used with a GGUF target (--load-format gguf): "
            "its packed LM head rows cannot be sliced. Use a safetensors checkpoint."
        )
    options = FrSpecOptions.from_env()  # an unknown option fails here, not in every scheduler
    if options.adapt:  # every scheduler checks it again where it builds the adapter
        mode = cfg.disaggregation_mode
        check_adaptation_setup(mode if mode in PD_MODES else None, _attn_dp_size(cfg) > 1)
    ids = load_token_map_ids(token_map)
    if cfg.speculative_eagle_topk is not None:  # resolved by SGLang (the worker checks it again)
        check_hot_ids_cover_topk(int(torch.unique(ids).numel()), cfg.speculative_eagle_topk, source=token_map)
    vocab_size = _target_vocab_size(cfg)
    if vocab_size is not None:
        canonical_hot_ids(ids, vocab_size, source=token_map)
    if cfg.tp_size > 1:
        _check_hooks_active()


def _attn_dp_size(cfg) -> int:
    """DP attention's width from the arguments being resolved, as the running SGLang has it."""
    if running_form("attn_dp_size") == "derived":
        from sglang.srt.runtime_context import attn_dp_size_of

        return attn_dp_size_of(cfg)
    return cfg.attn_dp_size
