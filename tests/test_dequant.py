"""Core pieces of the quantized-head path (torch only): FP8 row dequantization against an
independent per-element computation."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core.dequant import dequantize_fp8_rows

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _quantized_rows(rows: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows, each quantized with its own scale, and those scales."""
    weight = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    scales = weight.abs().amax(dim=1) / FP8_MAX
    return (weight / scales[:, None]).to(torch.float8_e4m3fn), scales


def test_per_row_and_per_tensor_scales_dequantize_elementwise():
    quantized, scales = _quantized_rows(7, 16, seed=0)
    # Per element, in float32: value times its row's scale.
    expected = torch.tensor(
        [[float(q) * float(scales[i]) for q in row.float()] for i, row in enumerate(quantized)]
    )
    assert torch.equal(dequantize_fp8_rows(quantized, scales, torch.float32), expected)
    assert torch.equal(dequantize_fp8_rows(quantized, scales[:, None], torch.float32), expected)  # [n, 1]
    assert torch.equal(dequantize_fp8_rows(quantized, scales, torch.bfloat16), expected.bfloat16())
    one = scales[:1]
    expected_one = torch.tensor([[float(q) * float(one) for q in row.float()] for row in quantized])
    assert torch.equal(dequantize_fp8_rows(quantized, one.reshape(()), torch.float32), expected_one)


def test_rows_that_are_not_fp8_or_scales_that_fit_nothing_are_errors():
    quantized, scales = _quantized_rows(4, 8, seed=1)
    with pytest.raises(ValueError, match="expected 2-D float8_e4m3fn rows, got torch.float32"):
        dequantize_fp8_rows(quantized.float(), scales, torch.float32)
    with pytest.raises(ValueError, match="a scale of 3 values fits neither a tensor nor 4 rows"):
        dequantize_fp8_rows(quantized, scales[:3], torch.float32)
