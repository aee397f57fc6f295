"""Dequantizing rows of a quantized LM head shard (torch only)."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)


def dequantize_fp8_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``rows`` [n, hidden] times their scale, in float32, cast to ``dtype``.

    ``scale`` is one value for the whole tensor (per-tensor) or one value per row (``[n]`` or
    ``[n, 1]``, per-channel), as the rows were quantized: ``rows = round(W / scale)``.
    """
    if rows.dtype not in FP8_DTYPES or rows.dim() != 2:
        raise ValueError(f"expected 2-D float8_e4m3fn rows, got {rows.dtype} of shape {tuple(rows.shape)}")
    if scale.numel() == 1:
        factor = scale.reshape(()).float()
    elif scale.numel() == rows.shape[0]:
        factor = scale.reshape(-1, 1).float()
    else:
        raise ValueError(f"a scale of {scale.numel()} values fits neither a tensor nor {rows.shape[0]} rows")
    return (rows.float() * factor).to(dtype)


# Bits a draft step reads per head element in each LM head format, scales included: MXFP8 has
# one 8-bit scale per 32 values, NVFP4 one FP8 scale per 16 (its per-tensor scale is negligible).
HEAD_FORMAT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "mxfp8": 8.25, "nvfp4": 4.5}


def head_bytes(rows: int, hidden: int, head_format: str) -> int:
    """Bytes of ``rows`` x ``hidden`` LM head rows stored in ``head_format``."""
    return round(rows * hidden * HEAD_FORMAT_BITS[head_format] / 8)
