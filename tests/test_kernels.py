"""Triton kernels against their torch references: the top-k packet and the hot-head GEMV.

On a CUDA machine the kernels run natively. Elsewhere ``test_kernels_in_triton_interpreter``
runs this file again in a child pytest with ``TRITON_INTERPRET=1`` (read when triton compiles a
kernel's decorator, so it must be set before the import, and setting it here would leak into
every other test of this process); there Triton's interpreter runs the kernels on CPU tensors.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from sglang_frspec.core import HotLogitsExchange
from sglang_frspec.core.plan import HotShardPlan

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
needs_kernels = pytest.mark.skipif(
    not (INTERPRETED or torch.cuda.is_available()),
    reason="runs in the TRITON_INTERPRET=1 child of test_kernels_in_triton_interpreter",
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def reference_exchange(width: int, count: int, offset: int) -> HotLogitsExchange:
    """A rank computing hot columns [offset, offset + count) in ``width`` slots."""
    num_hot = offset + count + 64  # other ranks hold the rest; k < H always
    plan = HotShardPlan(
        hot_ids=torch.arange(num_hot),
        shard_ranges=((0, offset), (offset, offset + count), (offset + count, num_hot)),
        layout="local",
        counts=(offset, count, num_hot - offset - count),
        width=max(width, offset, num_hot - offset - count),
    )
    return HotLogitsExchange(plan, rank=1)


def hard_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits whose first rows are the hard cases: all -inf, peaked, tied, part -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 3
    specials = [
        torch.full((width,), -math.inf),
        torch.randn(width, generator=gen).index_fill_(0, torch.tensor([width // 2]), 80.0),  # peaked
        torch.randint(0, 3, (width,), generator=gen).float(),  # three values: ties everywhere
        torch.randn(width, generator=gen).masked_fill_(torch.rand(width, generator=gen) < 0.7, -math.inf),
    ]
    for i, row in enumerate(specials[:rows]):
        x[i] = row
    return x.to(dtype).to(DEVICE)


def assert_same_packet(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # Values and ids bit for bit (the int view also tells -0.0 from 0.0); the rest within 1e-5.
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    assert torch.equal(got[:, : 2 * k].view(torch.int32), want[:, : 2 * k].view(torch.int32)), (got, want)
    torch.testing.assert_close(got[:, 2 * k], want[:, 2 * k], rtol=1e-5, atol=1e-6, equal_nan=True)


def special_rows(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows for the packet's ordering rules: ties on a coarse grid, -0.0 against 0.0, NaN of
    either sign, a NaN the top-k must take (as -inf), more +inf than k, all NaN."""
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(7, width, generator=gen)
    rows[0] = torch.randint(0, 4, (width,), generator=gen) * 0.5  # ties in every block
    rows[1] = -1.0 - torch.rand(width, generator=gen)
    zeros = torch.tensor([1, 4, 9, width // 2, width - 3, width - 1])
    rows[1, zeros] = torch.tensor([-0.0, -0.0, -0.0, 0.0, 0.0, 0.0])  # equal floats, -0.0 first
    rows[2].masked_fill_(torch.rand(width, generator=gen) < 0.3, math.nan)
    negative_nan = (torch.tensor(-math.inf) * 0.0).item()  # 0 * inf on x86: the sign bit set
    rows[3].masked_fill_(torch.rand(width, generator=gen) < 0.3, negative_nan)
    rows[4] = -math.inf
    rows[4, [0, width - 2]] = torch.tensor([math.nan, 1.0])
    rows[5, torch.randperm(width, generator=gen)[:12]] = math.inf
    rows[6] = math.nan
    return rows.to(dtype).to(DEVICE)


def packet_by_definition(local: torch.Tensor, count: int, offset: int, k: int) -> torch.Tensor:
    """The packet as documented, by a stable sort and float64 sums: the k largest values (NaN as
    -inf, ties to the lower column, zeros written as 0.0), their hot indices, and the
    log-sum-exp of the other columns (NaN if the row holds a NaN)."""
    x = local[:, :count].float().cpu()
    ranked = x.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :k]
    kept = order.shape[1]
    values = torch.full((x.shape[0], k), -math.inf)
    indices = torch.zeros(x.shape[0], k)
    top = ranked.gather(1, order)
    values[:, :kept] = torch.where(top == 0, 0.0, top)
    indices[:, :kept] = (order + offset).float()
    rest = torch.logsumexp(x.double().scatter(1, order, -math.inf), dim=1)
    rest = rest.masked_fill(x.isnan().any(1), math.nan).float()
    return torch.cat([values, indices, rest[:, None]], dim=1)


SPECIAL_CASES = [(301, 299, 5, 4), (4500, 4450, 17, 8)]  # width, count, offset, k: one block, two


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width,count,offset,k", SPECIAL_CASES)
def test_reference_packet_follows_its_definition(width, count, offset, k, dtype):
    local = torch.cat([special_rows(width, dtype), hard_rows(4, width, dtype, seed=width)])
    got = reference_exchange(width, count, offset).topk_packet_reference(local, k)
    assert_same_packet(got.cpu(), packet_by_definition(local, count, offset, k), k)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width,count,offset,k", SPECIAL_CASES)
def test_topk_packet_orders_ties_nan_and_signed_zeros_as_the_reference(width, count, offset, k, dtype):
    from sglang_frspec.kernels import topk_packet

    local = special_rows(width, dtype)
    want = reference_exchange(width, count, offset).topk_packet_reference(local, k)
    assert_same_packet(topk_packet(local, count, offset, k), want, k)


PACKET_CASES = [  # rows, width, count, offset, k
    (1, 37, 37, 0, 4),  # one row, odd width
    (5, 301, 299, 1000, 4),  # odd width, padding slots
    (3, 5003, 4500, 17, 8),  # more than one 4096-column block
    (4, 3, 3, 5, 4),  # width < k
    (4, 16, 0, 0, 4),  # a rank with no hot ids
    (64, 21, 19, 7, 9),  # 64 rows, k > 8
    (2, 9, 9, 0, 1),  # k = 1
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width,count,offset,k", PACKET_CASES)
def test_topk_packet_matches_reference(rows, width, count, offset, k, dtype):
    from sglang_frspec.kernels import topk_packet

    local = hard_rows(rows, width, dtype, seed=rows * width + k)
    want = reference_exchange(width, count, offset).topk_packet_reference(local, k)
    assert_same_packet(topk_packet(local, count, offset, k), want, k)


@needs_kernels
def test_topk_packet_rest_is_exact_for_a_peaked_row():
    from sglang_frspec.kernels import topk_packet

    # One logit 80 above the rest: 1 - top mass is 0 in float32, the rest's own sum is not.
    local = torch.randn(1, 2000, generator=torch.Generator().manual_seed(3))
    local[0, 123] = 80.0
    rest = local.double().clone()
    rest[0, local[0].topk(4).indices] = -math.inf
    packet = topk_packet(local.to(DEVICE), 2000, 0, 4).cpu()
    assert packet[0, 4] == 123.0
    torch.testing.assert_close(packet[0, -1].double(), torch.logsumexp(rest, 1)[0], rtol=1e-6, atol=0)


@needs_kernels
def test_exchange_packet_uses_the_kernel_on_cuda_and_the_reference_elsewhere():
    exchange = reference_exchange(300, 250, 11)
    local = hard_rows(6, 300, torch.bfloat16, seed=5)
    assert_same_packet(exchange.topk_packet(local, 4), exchange.topk_packet_reference(local, 4), 4)
    with pytest.raises(ValueError, match="0 < k < H"):
        exchange.topk_packet(local, exchange.num_hot)


@needs_kernels
def test_merged_kernel_packets_with_fillers_equal_the_full_logits():
    """Three ranks (7, 2 and 0 hot ids, k = 4): the last two pad their packets with fillers. Rows
    where fewer than k logits are finite (hot column 0 among them) must merge into exactly the
    full logits: every finite value at its column, -inf elsewhere (fillers overwrite nothing)."""
    from sglang_frspec.core.gather import merge_topk_packets
    from sglang_frspec.kernels import topk_packet

    counts, k = (7, 2, 0), 4
    full = torch.full((3, sum(counts)), -math.inf)
    full[0, [0, 8]] = torch.tensor([2.5, -1.0])  # column 0 and one on rank 1
    full[1, 0] = 7.0  # column 0 alone
    full[2, [1, 2, 3]] = torch.tensor([0.5, 0.5, 3.0])  # three on rank 0
    packets, offset = [], 0
    for count in counts:
        local = torch.full((3, 8), -math.inf)
        local[:, :count] = full[:, offset : offset + count]
        packets.append(topk_packet(local.to(DEVICE), count, offset, k).cpu())
        offset += count
    merged = merge_topk_packets(torch.stack(packets, dim=1), k, sum(counts))
    assert torch.equal(merged, full), (merged, full)


GEMV_CASES = [  # rows, n, k_dim, block_n, split_k
    (1, 45, 300, None, None),
    (7, 100, 513, 32, 3),
    (16, 33, 256, 16, 1),
    (64, 70, 300, None, 2),
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k_dim,block_n,split_k", GEMV_CASES)
def test_hot_head_gemv_matches_matmul(rows, n, k_dim, block_n, split_k, dtype):
    from sglang_frspec.kernels.gemv import hot_head_gemv

    gen = torch.Generator().manual_seed(rows + n)
    hidden = torch.randn(rows, k_dim, generator=gen).to(DEVICE)
    weight = (torch.randn(n, k_dim, generator=gen) * 0.05).to(DEVICE, dtype)
    got = hot_head_gemv(hidden, weight, block_n=block_n, split_k=split_k)
    want = hidden.to(dtype).float() @ weight.float().T  # float32 accumulation, like the kernel
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # output rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert torch.equal(hot_head_gemv(hidden, weight, block_n=block_n, split_k=split_k), got)  # no atomics


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,split_k,count", [(1, 1, 90), (9, 3, 97), (64, 2, 0)])
def test_fused_gemv_packet_equals_gemv_then_packet(rows, split_k, count, dtype):
    from sglang_frspec.kernels import topk_packet
    from sglang_frspec.kernels.gemv import gemv_topk_packet, hot_head_gemv

    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 600, generator=gen).to(DEVICE)
    weight = (torch.randn(104, 600, generator=gen) * 0.05).to(DEVICE, dtype)
    weight[count:] = 0  # padding slots of the hot head
    logits = hot_head_gemv(hidden, weight, split_k=split_k)
    got = gemv_topk_packet(hidden, weight, count, 40, 4, split_k=split_k)
    assert torch.equal(got, topk_packet(logits, count, 40, 4))  # the same sums, roundings and order
    assert_same_packet(got, reference_exchange(104, count, 40).topk_packet_reference(logits, 4), 4)


@needs_kernels
def test_kernels_reject_bad_arguments():
    from sglang_frspec.kernels import topk_packet
    from sglang_frspec.kernels.gemv import hot_head_gemv

    with pytest.raises(ValueError, match="k >= 1"):
        topk_packet(torch.zeros(2, 8, device=DEVICE), 8, 0, 0)
    with pytest.raises(ValueError, match="count must be within"):
        topk_packet(torch.zeros(2, 8, device=DEVICE), 9, 0, 2)
    with pytest.raises(ValueError, match="1..64 rows"):
        hot_head_gemv(torch.zeros(65, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))
