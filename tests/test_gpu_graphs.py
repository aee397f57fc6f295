"""On a CUDA device: the core exchanges capture into CUDA graphs and stay exact in bf16.

SGLang captures the draft forward into CUDA graphs, so the exchange must not sync with the host
or change shapes with data. One process holds every rank's view: the rank under test runs its
local GEMM and exchange inside the graph; the other ranks' gathered parts come from buffers
computed eagerly beforehand (the all-gather's output, as the real collective would fill it).
Skipped without a GPU (CI has none); run on a GPU machine with ``pytest tests/test_gpu_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import HotLogitsExchange, plan_hot_shards

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB, HIDDEN, NUM_HOT, ROWS, TOPK = 32000, 512, 4000, 8, 4


class EmulatedGather:
    """``all_gather(out, inp)`` for one rank: its own slot from ``inp``, the others from buffers."""

    def __init__(self, rank: int, others_by_width: dict[int, list[torch.Tensor]]):
        self.rank, self.others_by_width = rank, others_by_width

    def __call__(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        parts = list(self.others_by_width[inp.shape[-1]])
        parts[self.rank] = inp
        out.copy_(torch.cat(parts))


def _capture(step):
    """Warm ``step`` up on a side stream, as CUDA graph capture requires, then capture it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def _skewed_hot_ids(gen: torch.Generator) -> torch.Tensor:
    low = torch.randperm(VOCAB // 4, generator=gen)[: NUM_HOT * 3 // 4]
    high = VOCAB // 4 + torch.randperm(VOCAB * 3 // 4, generator=gen)[: NUM_HOT - low.numel()]
    return torch.cat([low, high])


def _ranks(tp: int, layout: str, device: torch.device):
    """Every rank's hot head and exchange, the hidden rows, the gathered parts and the reference."""
    gen = torch.Generator().manual_seed(tp)
    full = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(device, torch.bfloat16)
    plan = plan_hot_shards(_skewed_hot_ids(gen), VOCAB, tp, layout=layout)
    # Each rank's hot head holds the rows of its slice of the hot order (build_local_head's
    # contract, tested on real gloo groups); here they are cut from the full head directly.
    heads = []
    for r in range(tp):
        head = full.new_zeros(plan.width, HIDDEN)
        ids = plan.hot_ids[plan.offsets[r] : plan.offsets[r] + plan.counts[r]]
        head[: plan.counts[r]] = full[ids.to(device)]
        heads.append(head)
    exchanges = [HotLogitsExchange(plan, r, device) for r in range(tp)]
    hidden = torch.randn(ROWS, HIDDEN, generator=gen).to(device, torch.bfloat16)
    locals_ = [hidden @ head.T for head in heads]
    packets = [ex.topk_packet_reference(local, TOPK) for ex, local in zip(exchanges, locals_)]
    gathered = {plan.width: locals_, 2 * TOPK + 1: packets}
    reference = hidden.float() @ full[plan.hot_ids.to(device)].float().T
    return heads, exchanges, hidden, gathered, reference


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layout", ["local", "balanced"])
def test_exchanges_capture_and_replay_exactly_in_bf16(tp, layout):
    heads, exchanges, hidden, gathered, reference = _ranks(tp, layout, torch.device("cuda"))
    for rank in range(tp):
        static_hidden = hidden.clone()
        gather = EmulatedGather(rank, gathered)

        def step(rank=rank, static_hidden=static_hidden, gather=gather):
            local = static_hidden @ heads[rank].T
            return exchanges[rank].full(local, gather).float(), exchanges[rank].topk(local, TOPK, gather)

        eager_full, eager_topk = step()
        graph, (graph_full, graph_topk) = _capture(step)
        static_hidden.zero_()  # replay must read the static input, not a captured constant
        graph.replay()
        torch.cuda.synchronize()
        own = slice(exchanges[rank].offset, exchanges[rank].offset + exchanges[rank].count)
        assert torch.count_nonzero(graph_full[:, own]) == 0
        static_hidden.copy_(hidden)
        graph.replay()
        torch.cuda.synchronize()
        assert graph_full.shape == (ROWS, NUM_HOT) and graph_topk.dtype == torch.float32
        torch.testing.assert_close(graph_full, eager_full, rtol=0, atol=0)
        torch.testing.assert_close(graph_topk, eager_topk, rtol=0, atol=0)
        # bf16 logits against the fp32 reference: only the GEMM output rounding differs.
        torch.testing.assert_close(graph_full, reference, rtol=2e-2, atol=2e-2)
        # Top-k from the packet: the ids it picks hold the full logits' top-k values (bf16 ties
        # may pick another id of the same value), and the probabilities match.
        top_probs, top_ids = graph_topk.softmax(-1).topk(TOPK)
        torch.testing.assert_close(graph_full.gather(1, top_ids), graph_full.topk(TOPK).values)
        torch.testing.assert_close(top_probs, graph_full.softmax(-1).topk(TOPK).values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_triton_kernels_capture_and_replay_bit_identically(rows):
    """The GEMV, the packet and the fused pair in one graph: replays equal eager bit for bit."""
    kernels = pytest.importorskip("sglang_frspec.kernels")
    from sglang_frspec.kernels.gemv import gemv_topk_packet, hot_head_gemv
    from tests.test_kernels import assert_same_packet, reference_exchange

    gen = torch.Generator().manual_seed(rows)
    width, count, offset = 4008, 4001, 123
    weight = (torch.randn(width, HIDDEN, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    weight[count:] = 0
    hidden = torch.randn(rows, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    static_hidden = hidden.clone()

    def step():
        logits = hot_head_gemv(static_hidden, weight)
        packet = kernels.topk_packet(logits, count, offset, TOPK)
        return logits, packet, gemv_topk_packet(static_hidden, weight, count, offset, TOPK)

    eager = step()
    graph, captured = _capture(step)
    static_hidden.zero_()  # replay must read the static input, not a captured constant
    graph.replay()
    torch.cuda.synchronize()
    assert torch.count_nonzero(captured[0]) == 0
    static_hidden.copy_(hidden)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)
    logits, packet, fused = captured
    assert torch.equal(fused, packet)
    want = reference_exchange(width, count, offset).topk_packet_reference(logits, TOPK)
    assert_same_packet(packet, want, TOPK)
    torch.testing.assert_close(logits.float(), hidden.float() @ weight.float().T, rtol=2e-2, atol=2e-2)


def test_a_captured_draft_step_replays_the_adapted_map_after_an_in_place_swap():
    """The adaptive map rewrites hot_token_id and the hot head in place between steps; a graph
    captured before the swap (GEMM, exchange, top-k, the map to token ids, as SGLang's draft
    graph holds them) must replay exactly what an eager step computes after it."""
    from sglang_frspec.core import plan_from_ranges, vocab_shard_ranges
    from sglang_frspec.core.adapt import SCORE_SHIFT, choose_swaps, swap_groups
    from sglang_frspec.core.gather import place_hot_rows, shard_row_reader

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    full = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(device, torch.bfloat16)
    plan = plan_from_ranges(_skewed_hot_ids(gen).sort().values, vocab_shard_ranges(VOCAB, 1), "local")
    head = full[plan.hot_ids.to(device)].clone()
    hot_token_id = plan.hot_ids.to(device)
    exchange = HotLogitsExchange(plan, 0, device)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen).to(device, torch.bfloat16)

    def step():
        logits = exchange.full(hidden @ head.T, None).float()
        return hot_token_id[logits.topk(TOPK).indices]

    graph, captured = _capture(step)
    scores = torch.zeros(VOCAB, dtype=torch.int64, device=device)
    outside = torch.ones(VOCAB, dtype=torch.bool, device=device)
    outside[hot_token_id] = False
    # Ids the current logits' favourites are not: the swapped-in rows change what is picked.
    scores[torch.nonzero(outside).flatten()[::5]] = 50 << SCORE_SHIFT
    never_out = torch.zeros(0, dtype=torch.int64, device=device)
    swaps = choose_swaps(scores, hot_token_id, swap_groups(plan), never_out, 512)
    assert len(swaps) == 512
    addresses = (head.data_ptr(), hot_token_id.data_ptr())
    hot_token_id.index_copy_(0, swaps.positions.to(device), swaps.ids_in.to(device))
    # As the adapter applies a decision: positions and ids on the host, rows read on the device.
    place_hot_rows(
        shard_row_reader(full), swaps.ids_in.cpu(), plan, 0, None, head, positions=swaps.positions.cpu()
    )
    assert (head.data_ptr(), hot_token_id.data_ptr()) == addresses
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
    assert torch.equal(head, full[hot_token_id])  # the rows of the ids served now
