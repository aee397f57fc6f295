"""Rank-side functions for tests/test_quantized_heads.py (run on every rank by run_tp_group)."""

from __future__ import annotations

import torch


def quant_config(method: str, config: dict):
    """SGLang's quantization config ``method`` read from a checkpoint's ``config`` dict, with the
    fused-module names SGLang's model loader adds for Llama (none: it has no such attribute)."""
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.models.llama import LlamaForCausalLM

    packed = getattr(LlamaForCausalLM, "packed_modules_mapping", {})
    return QUANTIZATION_METHODS[method].from_config(config | {"packed_modules_mapping": packed})


def loaded_head(vocab: int, hidden: int, dtype: torch.dtype, full: torch.Tensor, config):
    """A real ParallelLMHead under ``config``, loaded from ``full`` by its own weight_loader and
    processed after loading as SGLang's model loader does."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(vocab, hidden, quant_config=config, prefix="lm_head", params_dtype=dtype)
    head.weight_loader(head.weight, full)
    head.quant_method.process_weights_after_loading(head)
    return head


def excluded_head_logits(payload: dict) -> dict:
    """For every (name, method, config) case: the head's quant method, whether the plugin accepts
    it, and (if it does) the plugin's draft logits of both layouts with the full exchange, next
    to the independent reference ``h @ W[hot].T`` from the full checkpoint."""
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import check_head_supported, describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import UnsupportedSetupError, build_local_head, plan_from_ranges
    from tests.rank_cases import _draft_head

    vocab, hidden, dtype = payload["vocab"], payload["hidden"], getattr(torch, payload["dtype"])
    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
    hidden_states = torch.randn(payload["rows"], hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    hot = torch.tensor(sorted(set(payload["map"])))
    reference = hidden_states.float() @ full[hot].float().T
    model_config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    out = {}
    for name, method, config in payload["cases"]:
        head = loaded_head(vocab, hidden, dtype, full, quant_config(method, config))
        case = {"method": type(head.quant_method).__name__, "reference": reference}
        try:
            check_head_supported(head)
        except UnsupportedSetupError as e:
            out[name] = case | {"error": str(e)}
            continue
        shard = describe_head_shard(head)
        for layout in ("local", "balanced"):
            plan = plan_from_ranges(hot, shard.shard_ranges, layout)
            local_head = build_local_head(head.weight, plan, shard.rank, shard.all_gather)
            processor = FrSpecLogitsProcessor(model_config, plan, shard, "full", 2, "cpu")
            draft = _draft_head(vocab, hidden, dtype, local_head)
            case[layout] = processor._get_logits(hidden_states, draft, None, use_logits_buffer=False)
        out[name] = case
    return out
