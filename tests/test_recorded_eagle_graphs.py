"""SGLang's EAGLE graph runners with the plugin at TP=2 (draft decode, draft extend, and the
target's verify and decode), their graphs recorded and replayed as ops on the captured buffers
(``tests/harness/gpu_defaults/recorded_graphs.py``), as a GPU replays a captured graph: frozen
Python, fixed addresses, collectives re-issued in order.

On a real gloo TP=2 group, the plugin's own start-up hook installs the hot head and the
hot-logits processor (each layout, each exchange) on a one-layer draft over SGLang's
vocab-parallel embedding, LM head and logits processor; SGLang's ``EAGLEDraftCudaGraphRunner``
captures ``draft_forward`` and replays batches of other values and sizes, padded to a captured
size. Each replay must equal ``draft_forward`` run eagerly on the same batch (bit for bit, or up
to float32 rounding where a product ran padded: ``assert_replay_equals_eager``). The drafted tokens
then go through SGLang's ``DecodeCudaGraphRunner`` of a one-layer target (TARGET_VERIFY, the
LM head the draft's hot head is gathered from), whose replays must equal the target run eagerly.
Faults a GPU would refuse, injected into the plugin, must fail with the recorder's error
(``tests/rank_cases_graphs.py``). On the same group, the recorder's own collective handling: a
functional all-reduce's replay, and a capture in which one rank skips a collective."""

from __future__ import annotations

import datetime

import pytest
import torch

from sglang_frspec.demo.fixtures import perm_fixture
from tests import rank_cases_graphs
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_adapters import skewed_ids

pytestmark = pytest.mark.multirank

VOCAB, HOT, HIDDEN, STEPS, TEMPERATURE = 2048, 300, 32, 3, 0.7
CAPTURE_SIZES = [1, 4]
# (rows, seed, all greedy): 3 rows replay padded to 4; under rejection sampling the sampled
# batches keep a captured size (a padded row draws its own random numbers, so eager's would differ)
REPLAYS = [(3, 11, True), (4, 12, False), (1, 13, False), (4, 14, True)]
REFUSED_SYNC = "Exception: Capture cuda graph failed: aten._local_scalar_dense.default inside a graph capture"
CASES = [("local", "full", False), ("local", "topk", False), ("balanced", "full", False),
         ("balanced", "topk", False), ("local", "full", True), ("balanced", "full", True)]  # fmt: skip


def assert_replay_equals_eager(replay: torch.Tensor, eager: torch.Tensor, rows: int, what: object) -> None:
    """Bit-equal where the graph ran the batch at its own size; where it ran it padded to a
    captured size (3 rows to 4), equal up to float32 rounding: a matrix product's summation order
    may depend on its row count (MKL on an AVX2 AMD EPYC: rows 0-2 of a 4-row product differ from
    the 3-row product in the last bits; cuBLAS also picks its kernel by shape), so eager on 3 rows
    is not the padded replay's bit pattern on every machine."""
    assert replay.shape == eager.shape, what
    if rows in CAPTURE_SIZES:
        assert torch.equal(replay, eager), what
    else:
        torch.testing.assert_close(replay, eager, rtol=1.3e-6, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """``rank_cases_graphs.recorded_eagle_graph_cases`` on both ranks of one TP=2 group."""
    perm = perm_fixture()
    # each case sets rejection sampling itself (SGLang's scoped override); the map's ids are the payload's
    server_args = rank_cases_graphs.rejection_sampling_server_args(
        perm.draft, perm.token_map("hot"), STEPS, CAPTURE_SIZES
    )
    payload = {"vocab": VOCAB, "hot": HOT, "hidden": HIDDEN, "steps": STEPS, "temperature": TEMPERATURE,
               "max_running": 48, "map_ids": skewed_ids(VOCAB, HOT), "replays": REPLAYS,
               "collective timeout": datetime.timedelta(seconds=1)}  # fmt: skip
    return run_tp_group(rank_cases_graphs.recorded_eagle_graph_cases, 2, payload, timeout=300,
                        server_args=server_args)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'rejection' if c[2] else 'greedy'}")
def test_replays_equal_eager(ranks, case):
    """Every replay (other values than the capture's; 3 rows padded to 4) returns what
    ``draft_forward`` returns run eagerly on the same batch: parents, score indices, the drafted
    tokens and, under rejection sampling, the hot q; the same on both ranks."""
    layout, exchange, rejection_sampling = case
    for rank in ranks:
        out = rank[case]
        assert out["exchange"] == ("full" if rejection_sampling else exchange)
        variants = ["None", "greedy"] if rejection_sampling else ["None"]  # the all-greedy graph has no q
        assert out["keys"] == sorted((size, v) for size in CAPTURE_SIZES for v in variants)
        for rows, seed, greedy in REPLAYS:
            replay, eager = out[(rows, seed, greedy)]["replay"], out[(rows, seed, greedy)]["eager"]
            for r, e in zip(replay, eager, strict=True):
                assert (r is None) == (e is None)
                if r is not None:
                    assert r.shape == e.shape and torch.equal(r, e), (rows, seed, greedy)
            tokens, q = replay[2], replay[3]
            assert tokens.shape == (rows, STEPS)
            if rejection_sampling and not greedy:
                assert q.shape == (rows, STEPS, HOT)
            else:
                assert q is None
    for key in ranks[0][case]:
        if isinstance(key, tuple):
            assert all(torch.equal(a, b) for a, b in zip(ranks[0][case][key]["replay"][2:3],
                                                           ranks[1][case][key]["replay"][2:3]))  # fmt: skip


@pytest.mark.parametrize("layout", ["local", "balanced"])
@pytest.mark.parametrize("exchange", ["full", "topk"])
def test_draft_extend_replays_equal_eager(ranks, layout, exchange):
    """SGLang's draft-extend runner: the processor writes the H-wide logits into SGLang's shared
    graph buffer, and every replay (3 rows padded to 4, the selected rows differing per batch)
    returns the logits and hidden states of the draft's forward run eagerly on the same batch."""
    for rank in ranks:
        out = rank[("extend", layout, exchange)]
        assert out["exchange"] == exchange
        assert out["buffer"] == (max(CAPTURE_SIZES), HOT)
        for rows, seed, _ in REPLAYS:
            case = out[(rows, seed)]
            assert case["in buffer"]
            (logits, hidden), (eager_logits, eager_hidden) = case["replay"], case["eager"]
            assert logits.shape == (rows, HOT) and hidden.shape == (rows, HIDDEN)
            assert_replay_equals_eager(logits, eager_logits, rows, ("logits", rows, seed))
            assert_replay_equals_eager(hidden, eager_hidden, rows, ("hidden", rows, seed))
        for sequence in out["collectives"].values():  # the embedding's all-reduce, the exchange's gather
            assert [c.split("(")[0] for c in sequence] == [
                "c10d.allreduce_.default",
                "c10d._allgather_base_.default",
            ]
    for key in ranks[0][("extend", layout, exchange)]:
        if isinstance(key, tuple):
            a, b = (rank[("extend", layout, exchange)][key]["replay"][0] for rank in ranks)
            assert torch.equal(a, b)


VERIFY_CASES = [("verify", lay, ex) for lay in ("local", "balanced") for ex in ("full", "topk")]
VERIFY_CASES += [("verify", "balanced", "full", "rejection")]


@pytest.mark.parametrize("case", VERIFY_CASES, ids="-".join)
def test_target_verify_replays_the_plugins_drafts(ranks, case):
    """One EAGLE step in graphs: the plugin's draft-decode graph drafts target ids from the map
    (greedy in each layout and exchange; sampled from the hot q under rejection sampling), and
    SGLang's target runner, captured in TARGET_VERIFY mode, verifies them: every replay (3 rows
    padded to 4) returns the full-vocab logits and hidden states of the target run eagerly on the
    same batch, on both ranks, and each graph re-issues the embedding's all-reduce and the
    logits' all-gather."""
    map_ids = set(skewed_ids(VOCAB, HOT))
    outs = [rank[case] for rank in ranks]
    for out in outs:
        assert out["mode"] == "TARGET_VERIFY" and out["keys"] == CAPTURE_SIZES
        for rows, seed, _ in REPLAYS:
            case = out[(rows, seed)]
            assert case["drafted"].shape == (rows, STEPS)
            assert set(case["drafted"].flatten().tolist()) <= map_ids  # target ids of the map
            (logits, hidden), (eager_logits, eager_hidden) = case["replay"], case["eager"]
            tokens = rows * (STEPS + 1)
            assert logits.shape == (tokens, VOCAB) and hidden.shape == (tokens, HIDDEN)
            assert_replay_equals_eager(logits, eager_logits, rows, ("logits", rows, seed))
            assert_replay_equals_eager(hidden, eager_hidden, rows, ("hidden", rows, seed))
        for sequence in out["collectives"].values():
            names = [c.split("(")[0] for c in sequence]
            assert names == ["c10d.allreduce_.default", "c10d._allgather_base_.default"]
    for rows, seed, _ in REPLAYS:
        a, b = (out[(rows, seed)] for out in outs)
        assert torch.equal(a["drafted"], b["drafted"]) and torch.equal(a["replay"][0], b["replay"][0])


def test_target_decode_replays_equal_eager_and_a_replaced_head_fails(ranks):
    """SGLang's target decode runner (no speculation) beside the plugin's draft: replays equal
    the target run eagerly; the target's LM head rebound after capture fails the replay (the
    graph would read freed memory)."""
    for rank in ranks:
        out = rank["target decode"]
        assert out["mode"] == "DECODE" and out["keys"] == CAPTURE_SIZES
        for rows, seed, _ in REPLAYS:
            replay, eager = out[(rows, seed)]["replay"], out[(rows, seed)]["eager"]
            assert replay.shape == (rows, VOCAB)
            assert_replay_equals_eager(replay, eager, rows, (rows, seed))
        assert out["head replaced"].startswith("GraphReplayError:"), out["head replaced"]


@pytest.mark.parametrize("layout", ["local", "balanced"])
def test_map_swap_and_head_refresh_after_capture_reach_the_graph(ranks, layout):
    """After capture, the plugin's adaptive map swaps ids in and its head refresh re-reads an
    updated weight, both in place: the next replays equal ``draft_forward`` run eagerly (q over
    every hot column, the sampled tokens), and each changed q, so the graph read the new state."""
    rows, seed, greedy = REPLAYS[1]
    for rank in ranks:
        out = rank[(layout, "full", True)]
        swap_and_refresh = out["swap and refresh"]
        assert swap_and_refresh["swapped"] > 0
        stages = [
            out[(rows, seed, greedy)],
            swap_and_refresh["after swap"],
            swap_and_refresh["after refresh"],
        ]
        for stage in stages[1:]:
            assert all(torch.equal(r, e) for r, e in zip(stage["replay"], stage["eager"], strict=True))
        q = [stage["replay"][3] for stage in stages]
        assert not torch.equal(q[0], q[1]) and not torch.equal(q[1], q[2])


def test_collectives_are_recorded_in_the_graph(ranks):
    """Each captured graph re-issues the embedding's all-reduce and the plugin's all-gather, the
    same sequence on both ranks (the backend compares them at capture)."""
    for case in CASES:
        collectives = ranks[0][case]["collectives"]
        assert collectives == ranks[1][case]["collectives"]
        for sequence in collectives.values():
            names = [c.split("(")[0] for c in sequence]
            assert names.count("c10d._allgather_base_.default") == STEPS - 1, sequence
            assert names.count("c10d.allreduce_.default") == STEPS - 1, sequence


def test_what_a_gpu_would_refuse_fails(ranks):
    """Injected into the plugin: a Python branch on a tensor value in the exchange and an
    ``.item()`` in the head guard fail the capture (SGLang's 'Capture cuda graph failed'); a
    runner buffer and the worker's ``hot_token_id`` replaced after capture fail the replay. The
    control, the same setup without injection, replays."""
    for rank in ranks:
        faults = rank["faults"]
        assert faults["control"] is None
        for name, where in (("branch in the exchange", "full_with_a_branch"),
                            (".item() in the head guard", "check_head_with_item")):  # fmt: skip
            assert faults[name].startswith(REFUSED_SYNC), faults[name]
            assert "rank_cases_graphs.py:" in faults[name] and f"({where})" in faults[name]
        assert faults["buffer replaced"].startswith(
            "GraphReplayError: EagleDraftInputBuffers.hidden_states was replaced after capture"
        ), faults["buffer replaced"]
        assert faults["hot_token_id replaced"].startswith(
            "GraphReplayError: EagleDraftWorker.hot_token_id was replaced after capture"
        ), faults["hot_token_id replaced"]


def test_a_functional_all_reduce_replays_the_reduced_values(ranks):
    """The replay waits on the functional all-reduce before copying its output: every rank returns
    2 * (value + 2 * value) + 1, the sum over both ranks, not its own part."""
    for rank in ranks:
        for value, replay in rank["collective captures"]["replays"].items():
            assert replay.tolist() == [6 * value + 1] * 4, (value, replay)


def test_a_collective_one_rank_skips_fails_the_capture_within_the_timeout(ranks):
    """Rank 1 skips the all-reduce rank 0 issues: rank 0's capture fails with the recorder's error
    after the 1 s collective timeout, not the group's (minutes); rank 1's capture holds no collective."""
    error = ranks[0]["collective captures"]["skipped"]
    assert error.startswith("GraphCaptureError: c10d.allreduce_.default did not complete within 1 s"), error
    assert "rank_cases_graphs.py:" in error and "(skipping)" in error
    assert ranks[0]["collective captures"]["seconds"] < 10
    assert ranks[1]["collective captures"]["skipped"] is None


def test_a_functional_collective_one_rank_skips_fails_the_capture_within_the_timeout(ranks):
    """The same with a functional all-reduce, whose ``wait_tensor`` takes no timeout: rank 0's
    capture fails with the recorder's error after the 1 s collective timeout, before the group's
    6 s (SGLang's groups: 300 s)."""
    captures = ranks[0]["collective captures"]
    error = captures["skipped functional"]
    assert error.startswith(
        "GraphCaptureError: _c10d_functional.all_reduce.default did not complete within 1 s"
    ), error
    assert "rank_cases_graphs.py:" in error and "(skipping_functional)" in error
    assert captures["functional seconds"] < 5
    assert ranks[1]["collective captures"]["skipped functional"] is None
