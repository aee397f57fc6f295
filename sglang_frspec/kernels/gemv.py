"""Hot-head product ``hidden @ weight.T`` for small row counts (Triton), optionally fused with
the top-k packet.

At 1-64 rows the product streams the weight once; its floor is the weight's bytes at HBM
bandwidth. A small shard (TP=8: 4096 x 4096 bf16, 34 MB) split only over output rows leaves
most SMs without enough bytes in flight, so the weight is cut into ``BLOCK_N`` rows x
``split_k`` slices of the hidden dimension: one program each, sized so there are several
programs per SM. Split-K partials are summed in split order by a second kernel (never by
atomics), so results are deterministic and replay bit-identically in a CUDA graph. The fused
variant hands the float32 partials to the packet kernel, which sums them in the same order
and rounds to the head dtype: its packet equals ``topk_packet(hot_head_gemv(...))`` bit for bit,
and the ``[rows, width]`` logits are never written.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from sglang_frspec.kernels.packet import _TRITON_DTYPES, round_through, topk_packet_of_partials

_BLOCK_K = 256
_PROGRAMS_PER_SM = 4  # programs in flight per SM that keep enough loads outstanding
_INTERPRETER_SMS = 4  # CPU tensors under TRITON_INTERPRET: no SMs, a small fixed count
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton when it imports, as here


@triton.jit
def _gemv_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    rows,
    n,
    k_dim,
    k_per_split,
    h_stride,
    w_stride,
    out_split_stride,
    out_row_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_split = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_first = pid_split * k_per_split
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_first + k0 + tl.arange(0, BLOCK_K)
        k_ok = (kk < k_dim) & (k0 + tl.arange(0, BLOCK_K) < k_per_split)
        h = tl.load(
            h_ptr + r[:, None] * h_stride + kk[None, :], mask=(r < rows)[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + c[:, None] * w_stride + kk[None, :], mask=(c < n)[:, None] & k_ok[None, :], other=0.0
        )
        if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly in tl.dot; exact in fp32
            h, w = h.to(tl.float32), w.to(tl.float32)
        if IEEE:  # fp32 heads: no tf32 rounding of the inputs
            acc += tl.dot(h, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w))
    out = out_ptr + pid_split * out_split_stride + r[:, None] * out_row_stride + c[None, :]
    tl.store(out, round_through(acc, OUT_DTYPE).to(OUT_DTYPE), mask=(r < rows)[:, None] & (c < n)[None, :])


@triton.jit
def _sum_splits_kernel(
    partials_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.load(partials_ptr + offs, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLIT):  # split order: the packet kernel sums the same way
        total += tl.load(partials_ptr + split * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, round_through(total, OUT_DTYPE).to(OUT_DTYPE), mask=ok)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(rows: int, n: int, k_dim: int, sms: int) -> tuple[int, int]:
    """(BLOCK_N, split_k): enough programs for ``_PROGRAMS_PER_SM`` per SM, each >= one K block."""
    if not 1 <= rows <= 64:
        raise ValueError(f"hot_head_gemv is for 1..64 rows, got {rows}; use hidden @ weight.T")
    block_n = 32 if rows <= 16 else 16  # more rows: more accumulator registers per column
    n_blocks = max(1, triton.cdiv(n, block_n))
    split_k = max(1, min(triton.cdiv(sms * _PROGRAMS_PER_SM, n_blocks), triton.cdiv(k_dim, _BLOCK_K)))
    return block_n, split_k


def _partials(hidden: torch.Tensor, weight: torch.Tensor, n: int, block_n: int | None, split_k: int | None,
              out_dtype: torch.dtype) -> tuple[torch.Tensor, int]:  # fmt: skip
    """[split_k, rows, n] products of ``hidden`` with the first ``n`` rows of ``weight``."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [rows, K] and weight [N, K], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    rows, k_dim = hidden.shape
    auto_n, auto_split = gemv_config(rows, n, k_dim, _sm_count(weight.device))
    block_n, split_k = block_n or auto_n, split_k or auto_split
    hidden = hidden.to(weight.dtype).contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k_dim, split_k), _BLOCK_K) * _BLOCK_K
    split_k = triton.cdiv(k_dim, k_per_split)  # no empty splits
    out = torch.empty((split_k, rows, n), dtype=out_dtype, device=weight.device)
    if n:
        _gemv_kernel[(triton.cdiv(n, block_n), split_k)](
            hidden, weight, out, rows, n, k_dim, k_per_split, hidden.stride(0), weight.stride(0),
            out.stride(0), out.stride(1), BLOCK_R=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
            BLOCK_K=_BLOCK_K, IEEE=weight.dtype == torch.float32 or _INTERPRETED, UPCAST=_INTERPRETED,
            OUT_DTYPE=_TRITON_DTYPES[out_dtype],
        )  # fmt: skip
    return out, split_k


def hot_head_gemv(hidden: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                  split_k: int | None = None) -> torch.Tensor:  # fmt: skip
    """``hidden.to(weight.dtype) @ weight.T`` in the weight's dtype (float32 accumulation), [rows, N]."""
    n = weight.shape[0]
    partials, split_k = _partials(hidden, weight, n, block_n, split_k, torch.float32)
    if split_k == 1:
        return partials[0].to(weight.dtype)
    out = torch.empty(partials.shape[1:], dtype=weight.dtype, device=weight.device)
    if out.numel():
        _sum_splits_kernel[(triton.cdiv(out.numel(), 1024),)](
            partials, out, out.numel(), SPLIT=split_k, BLOCK=1024, OUT_DTYPE=_TRITON_DTYPES[weight.dtype]
        )
    return out


def gemv_topk_packet(hidden: torch.Tensor, weight: torch.Tensor, count: int, offset: int, k: int,
                     block_n: int | None = None, split_k: int | None = None) -> torch.Tensor:  # fmt: skip
    """``topk_packet(hot_head_gemv(hidden, weight), count, offset, k)`` without writing the logits;
    only the first ``count`` weight rows are read."""
    if not 0 <= count <= weight.shape[0]:
        raise ValueError(f"count must be within the {weight.shape[0]} head rows, got count={count}")
    partials, _ = _partials(hidden, weight, count, block_n, split_k, torch.float32)
    return topk_packet_of_partials(partials, count, offset, k, round_to=weight.dtype)
