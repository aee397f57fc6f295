"""The per-rank top-k packet in one read of the local logits (Triton).

Semantics are those of ``HotLogitsExchange.topk_packet`` (the torch reference): per row, over the
first ``count`` of ``width`` columns, the k largest values in descending order (ties: the lower
column first; -0.0 equals 0.0 and is written as 0.0; NaN ranks and is written as -inf), their
hot indices ``column + offset`` as float32, and the log-sum-exp of every other column, summed
from positive terms only (exact for peaked rows), NaN if the row holds a NaN. Slots beyond
``count`` hold ``(-inf, 0)``; a rank with no hot ids sends ``(-inf, 0, ..., -inf)``.

One program per row streams the row in ``BLOCK`` columns. Candidates are packed into int64 keys
(order-preserving float bits above the complemented column, the packing of SGLang's
``row_logsumexp_topk``), so "larger key" is "larger value, then lower column" and every key is
distinct. A block whose best key does not beat the running k-th key adds all its columns to the
rest; otherwise its best keys are inserted one by one, each insertion evicting the running
minimum into the rest. The rest is a running (max, sum of exp) of exactly the columns outside
the final top-k, so no top mass is ever subtracted; NaN is kept out of it (Triton leaves NaN in
``max`` unspecified) and reported by a flag instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096  # columns per step: a [4096] fp32 row slice stays in registers with 8 warps
_EMPTY_COLUMN = 2147483647  # column of the "empty" key: loses against every real column


@triton.jit
def _pack_keys(values, columns):
    """fp32 values + int32 columns -> distinct int64 keys ordered by (value, then lower column)."""
    bits = values.to(tl.uint32, bitcast=True)
    sortable = bits ^ tl.where((bits & 0x80000000) != 0, 0xFFFFFFFF, 0x80000000)
    return (sortable.to(tl.int64) << 31) | (2147483647 - columns).to(tl.int64)


@triton.jit
def _key_values(keys):
    sortable = ((keys >> 31) & 0xFFFFFFFF).to(tl.uint32)
    bits = sortable ^ tl.where((sortable & 0x80000000) == 0, 0xFFFFFFFF, 0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_columns(keys):
    return 2147483647 - (keys & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def round_through(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (to nearest, ties to even, as torch casts), back in fp32.

    bfloat16 by its bits: Triton's interpreter truncates a float32 -> bfloat16 cast.
    """
    if DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr, not a constant)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_lse(m_a, s_a, m_b, s_b):
    """Merge two (max, sum of exp(x - max)) accumulators; -inf maxima contribute nothing."""
    m_new = tl.maximum(m_a, m_b)
    scale_a = tl.where(m_a == m_new, 1.0, tl.exp(m_a - m_new))
    scale_b = tl.where(m_b == m_new, 1.0, tl.exp(m_b - m_new))
    return m_new, s_a * scale_a + s_b * scale_b


@triton.jit
def _topk_packet_kernel(
    x_ptr,
    out_ptr,
    row_stride,
    split_stride,
    count,
    offset,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    ROUND: tl.constexpr,
    ROUND_TO: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    empty = _pack_keys(tl.full((K_PAD,), float("-inf"), tl.float32), tl.full((K_PAD,), 2147483647, tl.int32))
    # Pad slots (>= K) hold the largest key, so the running minimum is always a real slot.
    best = tl.where(slots < K, empty, 9223372036854775807)
    rest_max = float("-inf")
    rest_sum = 0.0
    has_nan = 0
    for start in range(0, count, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        valid = columns < count
        row_ptr = x_ptr + row * row_stride + columns
        x = tl.load(row_ptr, mask=valid, other=0.0).to(tl.float32)
        for split in tl.static_range(1, SPLIT):  # split-K partials of a fused GEMV, summed in order
            x += tl.load(row_ptr + split * split_stride, mask=valid, other=0.0)
        if ROUND:  # to the head dtype the unfused GEMV would have written
            x = round_through(x, ROUND_TO)
        is_nan = x != x
        has_nan = tl.maximum(has_nan, tl.max(tl.where(valid & is_nan, 1, 0)))
        # The reference's order: NaN as -inf, -0.0 as 0.0 (distinct bits, equal floats).
        x = tl.where(is_nan, float("-inf"), tl.where(x == 0.0, 0.0, x))
        keys = tl.where(valid, _pack_keys(x, columns), -1)
        kth = tl.min(best)
        top = tl.max(keys)
        while top > kth:
            # Insert the block's best key in place of the running minimum, which joins the rest.
            evicted = _key_values(kth)
            rest_max, rest_sum = _add_lse(
                rest_max, rest_sum, evicted, tl.where(evicted == float("-inf"), 0.0, 1.0)
            )
            best = tl.where(slots == tl.argmin(best, 0), top, best)
            keys = tl.where(keys == top, -1, keys)
            kth = tl.min(best)
            top = tl.max(keys)
        # Columns of this block that stayed out of the top-k join the rest.
        x_rest = tl.where(keys >= 0, x, float("-inf"))
        block_max = tl.max(x_rest)
        # All -inf: exp(-inf) = 0; a +inf: the sum is +inf, as torch.logsumexp's. Never inf - inf.
        shift = tl.where(tl.abs(block_max) == float("inf"), 0.0, block_max)
        block_sum = tl.sum(tl.exp(x_rest - shift))
        rest_max, rest_sum = _add_lse(rest_max, rest_sum, block_max, block_sum)
    best = tl.sort(tl.where(slots < K, best, -1), descending=True)
    values = _key_values(best)
    columns = _key_columns(best)
    indices = tl.where(columns == 2147483647, 0.0, (columns + offset).to(tl.float32))
    rest_lse = tl.where(rest_sum > 0.0, rest_max + tl.log(rest_sum), float("-inf"))
    rest_lse = tl.where(has_nan > 0, float("nan"), rest_lse)
    out_row = out_ptr + row * (2 * K + 1)
    tl.store(out_row + slots, values, mask=slots < K)
    tl.store(out_row + K + slots, indices, mask=slots < K)
    tl.store(out_row + 2 * K, rest_lse)


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _launch(x: torch.Tensor, rows: int, row_stride: int, split: int, split_stride: int, count: int,
            offset: int, k: int, round_to: torch.dtype | None) -> torch.Tensor:  # fmt: skip
    out = torch.empty((rows, 2 * k + 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(_MAX_BLOCK, triton.next_power_of_2(max(count, 16)))
        rounding = _TRITON_DTYPES[round_to or torch.float32]
        _topk_packet_kernel[(rows,)](
            x, out, row_stride, split_stride, count, offset, K=k, K_PAD=max(2, triton.next_power_of_2(k)),
            BLOCK=block, SPLIT=split, ROUND=round_to is not None, ROUND_TO=rounding,
            num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    return out


def _check(k: int, count: int, width: int) -> None:
    if k <= 0:
        raise ValueError(f"top-k packet needs k >= 1, got k={k}")
    if not 0 <= count <= width:
        raise ValueError(f"count must be within the {width} local columns, got count={count}")


def topk_packet(local: torch.Tensor, count: int, offset: int, k: int) -> torch.Tensor:
    """[rows, 2k+1] float32 packet (top-k values, hot indices, rest log-sum-exp) of ``local``.

    ``local`` is a rank's ``[rows, width]`` logits (fp32, fp16 or bf16, last dim contiguous);
    only its first ``count`` columns are read; ``offset`` is the hot index of column 0.
    """
    _check(k, count, local.shape[1])
    if local.stride(1) != 1:
        local = local.contiguous()
    return _launch(local, local.shape[0], local.stride(0), 1, 0, count, offset, k, None)


def topk_packet_of_partials(partials: torch.Tensor, count: int, offset: int, k: int,
                            round_to: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The packet of ``partials.sum(0)`` rounded to ``round_to``, from ``[split, rows, width]``
    float32 split-K GEMV partials (summed in split order, as the GEMV's own reduction does)."""
    _check(k, count, partials.shape[2])
    partials = partials.contiguous()
    return _launch(partials, partials.shape[1], partials.stride(1), partials.shape[0], partials.stride(0),
                   count, offset, k, round_to)  # fmt: skip


__all__ = ["topk_packet", "topk_packet_of_partials"]
