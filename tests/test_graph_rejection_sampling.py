"""Rejection sampling with a map under SGLang's draft-decode CUDA graph: every q the graph reads
is as wide as the map (H), not the target vocab (V).

SGLang 0.5.23's ``EAGLEDraftCudaGraphRunner`` allocates its q buffer ``[max_bs, V]``
(``eagle_draft_cuda_graph_runner.py:199-206``), copies the batch's q into it at replay (``:666``),
and its capture runs ``draft_forward``, which stacks it with each step's q (``eagle_worker_v2.py:778,
902``); with a map each step's q is ``[bs, H]``, so stock capture fails. These tests run SGLang's
own runner (``__init__``, ``capture_one_shape``, ``execute``) on the CPU at a Llama-3 vocab and a
32768-id map (``tests/rank_cases_graphs.py``), its graphs recorded and replayed as ops on the
captured buffers (``tests/harness/gpu_defaults/recorded_graphs.py``); a CUDA graph itself never
runs here.
"""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.demo.fixtures import perm_fixture
from tests import rank_cases_graphs
from tests.harness.tp_group import run_tp_group

VOCAB, HOT, HIDDEN, STEPS, ROWS, TEMPERATURE = 128256, 32768, 64, 3, 3, 0.7
CAPTURE_SIZES = [1, 4]  # ROWS replays padded to 4: the padded rows are zeroed, then cut off
HOT_IDS = torch.arange(HOT) * 3 + 1  # sorted and distinct, as the plugin's canonical order
# SGLang's errors without the plugin's hooks: the capture's stack (as reported from a GPU), the
# replay's copy of an idle batch's q
STOCK_STACK = (
    f"stack expects each tensor to be equal size, but got [4, {VOCAB}] at entry 0 and [4, {HOT}] at entry 1"
)
STOCK_COPY = (
    f"The size of tensor a ({HOT}) must match the size of tensor b ({VOCAB}) at non-singleton dimension 1"
)
REFUSED = (
    "--speculative-use-rejection-sampling with --speculative-token-map under CUDA graphs needs "
    "sglang-frspec's hook"
)


@pytest.fixture(scope="module")
def graph_cases() -> list[dict]:
    """``rank_cases_graphs.graph_cases`` on every rank of a real TP=2 group (about 20 s)."""
    perm = perm_fixture()
    server_args = rank_cases_graphs.rejection_sampling_server_args(
        perm.draft, perm.token_map("hot"), STEPS, CAPTURE_SIZES
    )
    payload = {"vocab": VOCAB, "hot": HOT, "hidden": HIDDEN, "steps": STEPS, "rows": ROWS,
               "temperature": TEMPERATURE, "hot_ids": HOT_IDS.tolist(), "max_running": 48,
               "map": perm.token_map("hot")}  # fmt: skip
    return run_tp_group(rank_cases_graphs.graph_cases, 2, payload, timeout=300, server_args=server_args)


@pytest.mark.multirank
def test_draft_decode_graph_captures_and_replays_the_hot_q(graph_cases):
    """Without the plugin's hook SGLang's capture fails as reported (the stack of the V-wide
    buffer with an H-wide step). With it: the buffer is H wide, a batch replays, and the q it
    returns is the batch's own q (through the replay's copy) then softmax(logits / T) of each
    step (an independent reference); an idle batch (SGLang's idle input, V wide) replays after
    the plugin's draft hook made its q H wide, and fails the replay's copy before."""
    out = graph_cases[0]["graph"]
    assert out["stock capture"].startswith(f"Exception: Capture cuda graph failed: {STOCK_STACK}")
    assert out["capture sizes"] == CAPTURE_SIZES
    assert out["buffer"] == (max(CAPTURE_SIZES), HOT)

    q = out["q"]
    assert q.shape == (ROWS, STEPS, HOT)
    assert torch.equal(q[:, 0], out["carried"])  # copied into the buffer, stacked first
    head = rank_cases_graphs.hot_draft_head(HOT, HIDDEN)
    step_q = torch.softmax(out["hidden_states"] @ head.T / TEMPERATURE, -1)  # the draft keeps its states
    for step in range(1, STEPS):
        torch.testing.assert_close(q[:, step], step_q, rtol=1e-5, atol=1e-8)
    assert torch.isin(out["tokens"], HOT_IDS).all()  # drafted tokens are map ids (hot_token_id in the graph)

    assert out["idle q from SGLang"] == (0, VOCAB)
    assert out["idle replay, stock"] == f"RuntimeError: {STOCK_COPY}"
    assert out["idle q"] == (0, HOT)
    assert out["idle replay q"] == (0, STEPS, HOT)
    assert all(torch.equal(rank["graph"]["q"], q) for rank in graph_cases[1:])  # the same on every rank


@pytest.mark.multirank
def test_drop_in_worker_refuses_graphs_without_the_plugins_hook_on_every_rank(graph_cases):
    """The drop-in worker without the plugin cannot size the graph's q buffer: where SGLang will
    capture the draft-decode graph, every rank refuses at start-up naming --disable-cuda-graph;
    without decode graphs, or with the plugin's hooks applied, it starts."""
    for rank in graph_cases:
        out = rank["drop-in"]
        assert out["graphs"].startswith(f"UnsupportedSetupError: {REFUSED}"), out
        assert "or pass --disable-cuda-graph" in out["graphs"]
        assert out["no graphs"] == "started"
        assert out["graphs, plugin loaded"] == "started"
