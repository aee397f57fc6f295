"""Quantized target LM heads: read SGLang's stored layout back and dequantize only the hot rows."""

from __future__ import annotations

import torch
from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8LinearMethod
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

from sglang_frspec.core import UnsupportedSetupError
from sglang_frspec.core.dequant import FP8_DTYPES, dequantize_fp8_rows

READABLE_FORMATS = "ModelOpt FP8 per-tensor (ModelOptFp8LinearMethod)"
# Names of the formats SGLang 0.5.23 can give a ParallelLMHead, for messages (not for decisions).
_FORMAT_NAMES = {
    "ModelOptFp4LinearMethod": "NVFP4",
    "ModelOptNvFp4A16LinearMethod": "W4A16 NVFP4",
    "GGUFEmbeddingMethod": "GGUF",
    "AWQLinearMethod": "AWQ int4 (packed qweight)",
    "GPTQLinearMethod": "GPTQ int4 (packed qweight)",
    "GPTQMarlinLinearMethod": "GPTQ int4 (Marlin)",
    "CompressedTensorsLinearMethod": "compressed-tensors",
}


def check_quantized_head_readable(module: VocabParallelEmbedding, quantization_tensors: list[str]) -> None:
    """Reject quantized heads whose stored layout cannot be read back row by row."""
    reason = _unreadable_reason(module)
    if reason:
        raise UnsupportedSetupError(
            f"the target LM head is quantized ({type(module.quant_method).__name__}) and holds "
            f"{', '.join(quantization_tensors)} besides plain rows: {reason} sglang-frspec "
            f"dequantizes the hot rows of {READABLE_FORMATS} heads only. Serve a checkpoint whose "
            "lm_head is left unquantized (lm_head in the quantization config's exclude_modules / "
            "ignore / modules_to_not_convert), or drop --speculative-token-map."
        )


def _unreadable_reason(module: VocabParallelEmbedding) -> str | None:
    """Why the head's rows cannot be read back, naming its format (None when they can)."""
    method = module.quant_method
    if hasattr(module, "weight_scale_inv"):  # Fp8LinearMethod: MXFP8 or block-scaled FP8
        if getattr(getattr(method, "quant_config", None), "use_mxfp8", False):
            return "an MXFP8 head, whose layout is not read back."
        return (
            "a block-scaled FP8 head (weight_scale_inv), which SGLang 0.5.23's vocab-parallel "
            "loader cannot load (it shards block scales as vocab rows)."
        )
    if not isinstance(method, ModelOptFp8LinearMethod):
        name = type(method).__name__
        return f"a {_FORMAT_NAMES.get(name, name)} head, whose layout is not read back."
    if method.use_marlin:
        return (
            "a ModelOpt FP8 head repacked for Marlin (a GPU without native FP8, or "
            "SGLANG_FORCE_FP8_MARLIN=1), whose rows cannot be read back."
        )
    weight, scale = module.weight, module.weight_scale
    stored_shape = (module.embedding_dim, module.num_embeddings_per_partition)  # transposed at load
    if weight.dtype not in FP8_DTYPES or tuple(weight.shape) != stored_shape:
        return (
            f"a ModelOpt FP8 head whose weight is {weight.dtype} of shape {tuple(weight.shape)}, "
            f"not float8_e4m3fn {stored_shape} as SGLang stores it after loading."
        )
    if scale.numel() not in (1, module.num_embeddings_per_partition):
        return (
            f"a ModelOpt FP8 head whose weight_scale has {scale.numel()} values, neither one nor one per row."
        )
    return None


def read_quantized_rows(
    module: VocabParallelEmbedding, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``rows`` (local indices) of a head check_quantized_head_readable accepted, in ``dtype``."""
    # ModelOptFp8LinearMethod stores the weight transposed ([hidden, rows]) after loading, with
    # one scale (or one per row where SGLang uses CUTLASS).
    rows = rows.to(module.weight.device)
    scale = module.weight_scale
    row_scale = scale if scale.numel() == 1 else scale.reshape(-1)[rows]
    return dequantize_fp8_rows(module.weight.t()[rows], row_scale, dtype)
