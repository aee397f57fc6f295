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


def scaled_fp8_quant_on_cpu(input: torch.Tensor, scale: torch.Tensor | None = None, **_) -> tuple:
    """Static per-tensor FP8 quantization as SGLang's own torch path computes it
    (``_native_static_quant_fp8`` in fp8_kernel.py): the CUDA kernel SGLang calls on other
    devices has no CPU build, and ModelOpt FP8 loading requantizes through it."""
    assert scale is not None and scale.numel() == 1, "only the static per-tensor path is needed"
    fp8 = torch.finfo(torch.float8_e4m3fn)
    return torch.clamp(input / scale, fp8.min, fp8.max).to(torch.float8_e4m3fn), scale


def modelopt_fp8_head(vocab: int, hidden: int, quantized: torch.Tensor, scale: torch.Tensor):
    """A real ParallelLMHead of a ModelOpt FP8 checkpoint whose lm_head is quantized, loaded from
    ``quantized`` [vocab, hidden] and its per-tensor ``scale`` by SGLang's own weight_loader and
    processed after loading (SGLang's stored layout)."""
    from unittest import mock

    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    config = quant_config("modelopt_fp8", {"quantization": {"quant_algo": "FP8", "exclude_modules": []}})
    head = ParallelLMHead(vocab, hidden, quant_config=config, prefix="lm_head", params_dtype=torch.bfloat16)
    head.weight_loader(head.weight, quantized)
    head.weight_loader(head.weight_scale, scale)
    head.weight_loader(head.input_scale, torch.tensor(1.0))
    with mock.patch("sglang.srt.layers.quantization.utils.scaled_fp8_quant", scaled_fp8_quant_on_cpu):
        head.quant_method.process_weights_after_loading(head)
    return head


def fp8_checkpoint(
    vocab: int, hidden: int, seed: int, per_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, scale, its dequantization) quantized here, independently of SGLang: one
    per-tensor scale, or with ``per_row`` one scale per row ([vocab, 1]), every row at its own
    magnitude so that no two rows share a scale (a reader taking another row's scale is caught)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    scale = weight.abs().max() / torch.finfo(torch.float8_e4m3fn).max
    if per_row:  # row r scaled by a distinct factor in [0.1, 10.1), its scale with it
        factor = 0.1 + 10 * torch.randperm(vocab, generator=gen).unsqueeze(1) / vocab
        weight, scale = weight * factor, scale * factor
    quantized = (weight / scale).to(torch.float8_e4m3fn)
    return quantized, scale, quantized.float() * scale


def store_fp8_shard(head, rows: tuple[int, int], quantized: torch.Tensor, scale: torch.Tensor) -> None:
    """Write vocab rows ``rows`` of a checkpoint into a loaded head in SGLang's stored layout
    (transposed weight), as an in-place weight update does. A per-row ``scale`` becomes the
    head's one-scale-per-row ``weight_scale`` ([rows per rank, 1], as convert_to_channelwise
    stores it); its padding rows keep scale 1."""
    start, end = rows
    head.weight.data[:, : end - start].copy_(quantized[start:end].t())
    if scale.numel() == 1:
        head.weight_scale.data.copy_(scale)
        return
    if head.weight_scale.numel() == 1:
        head.weight_scale = torch.nn.Parameter(
            torch.ones(head.num_embeddings_per_partition, 1), requires_grad=False
        )
    head.weight_scale.data[: end - start].copy_(scale[start:end])


def fp8_head_cases(payload: dict) -> dict:
    """A quantized ModelOpt FP8 head on this rank: its stored layout, whether the plugin accepts it,
    and per layout its hot head in float32 and bfloat16, the draft logits (float32 head and
    hidden states) and the hot head after the target's weights change in place and it refreshes.
    ``payload["per_row"]``: the head holds one distinct scale per row (``store_fp8_shard``)."""
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import build_hot_head, check_head_supported, describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.adapters.worker import FrSpecDraftHead
    from sglang_frspec.core import plan_from_ranges
    from sglang_frspec.core.options import FrSpecOptions
    from tests.rank_cases import _draft_head

    vocab, hidden, per_row = payload["vocab"], payload["hidden"], payload.get("per_row", False)
    head = modelopt_fp8_head(vocab, hidden, *fp8_checkpoint(vocab, hidden, seed=0)[:2])
    shard = describe_head_shard(head)
    rows = shard.shard_ranges[shard.rank]
    quantized, scale, _ = fp8_checkpoint(vocab, hidden, seed=0, per_row=per_row)
    if per_row:  # SGLang loads a ModelOpt head per tensor; the per-row checkpoint goes in place
        store_fp8_shard(head, rows, quantized, scale)
    check_head_supported(head)
    hot = torch.tensor(sorted(set(payload["map"])))
    hidden_states = torch.randn(payload["rows"], hidden, generator=torch.Generator().manual_seed(1))
    model_config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    out = {
        "rank": shard.rank,
        "method": type(head.quant_method).__name__,
        "stored": (tuple(head.weight.shape), head.weight.dtype, head.weight_scale.numel()),
    }
    new_quantized, new_scale, _ = fp8_checkpoint(vocab, hidden, seed=2, per_row=per_row)
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        case = {"columns": (plan.offsets[shard.rank], plan.counts[shard.rank])}
        case["bfloat16"] = build_hot_head(shard, plan, torch.bfloat16)
        local_head = build_hot_head(shard, plan, torch.float32)
        case["float32"] = local_head.clone()
        processor = FrSpecLogitsProcessor(model_config, plan, shard, "full", 2, "cpu")
        draft = _draft_head(vocab, hidden, torch.float32, local_head)
        case["logits"] = processor._get_logits(hidden_states, draft, None, use_logits_buffer=False)
        out[layout] = case
    for layout in ("local", "balanced"):
        # Weights updated in place in SGLang's stored layout; then the worker's refresh.
        store_fp8_shard(head, rows, quantized, scale)
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        state = FrSpecDraftHead(
            plan, shard, FrSpecOptions.from_env(), build_hot_head(shard, plan, torch.float32)
        )
        store_fp8_shard(head, rows, new_quantized, new_scale)
        before = state.local_head.data_ptr()
        state.refresh()
        out[layout]["refreshed"] = (state.local_head.clone(), state.local_head.data_ptr() == before)
    return out
