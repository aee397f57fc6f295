"""Weight updates refresh the hot head: once per completed update on every rank, for every
update path SGLang has (a real gloo group), and on a real TP=2 server updated from disk; an
adaptive map's later swaps read the updated rows, also when the update replaced the tensor."""

from __future__ import annotations

import shutil

import pytest
import torch

from sglang_frspec.adapters.contract import running_form
from sglang_frspec.core import vocab_shard_ranges
from tests import rank_cases_adapt, rank_cases_adapters
from tests.harness.releases import refused_flush_fails_the_update
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_adapters import skewed_ids

# (refreshes, head == hot rows of the weights it should hold at that point), per form of the
# weight-update seam (adapters/hooks.py VARIANTS).
EXPECTED_REFRESHES = {
    "sessions": {
        # The flush is refused on rank 0 only: its update reports failure, yet weights changed;
        # both ranks refresh together (no rank left alone in the balanced layout's collective).
        "disk_flush_refused_on_rank0": (1, True),
        "p2p_before_end": (0, True),  # written directly: still the previous rows until the end
        "p2p_end": (1, True),
        "tensor_chunks_before_end": (0, True),  # never once per chunk
        "tensor_chunks_end": (1, True),
        "distributed_chunks_before_end": (0, True),
        "distributed_chunks_end": (1, True),
        "ipc": (1, True),
        "end_without_session": (0, True),
    },
    # Releases without sessions (SGLang 0.5.20): every kind of update completes in one call.
    "one_call": {"disk": (1, True), "tensor": (1, True), "distributed": (1, True), "ipc": (1, True)},
}


@pytest.mark.multirank
@pytest.mark.every_release
def test_weight_updates_refresh_once_per_completed_update_on_every_rank():
    vocab, hidden = 5003, 32
    payload = {"vocab": vocab, "hidden": hidden, "map": skewed_ids(vocab, 700)}
    results = run_tp_group(rank_cases_adapters.weight_update_refresh, 2, payload, timeout=300)
    expected = dict(EXPECTED_REFRESHES[running_form("weight_updates")])
    refused_flush = "disk_flush_refused_on_rank0" in expected and refused_flush_fails_the_update()
    if "disk_flush_refused_on_rank0" in expected and not refused_flush:  # SGLang 0.5.21 asserts there
        expected = {"disk": expected.pop("disk_flush_refused_on_rank0"), **expected}
    for rank, result in enumerate(results):
        got = {case: (r["refreshes"], r["fresh"]) for case, r in result.items()}
        assert got == expected, rank
    if refused_flush:
        assert [r["disk_flush_refused_on_rank0"]["success"] for r in results] == [False, True]


def permuted_target(perm, tmp_path) -> tuple[str, dict[int, int]]:
    """A copy of the target whose head rows are permuted inside the hot set: greedy becomes
    x -> tau^-1(pi(x)), still inside the hot set. Returns its path and that greedy step on every
    hot id (pi on the hot set is the fixture's two chains, which wrap around both hot cycles)."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "target-b"
    shutil.copytree(perm.target, target)
    tensors = load_file(str(target / "model.safetensors"))
    hot = torch.load(perm.token_map("hot"))
    tau = hot[torch.randperm(hot.numel(), generator=torch.Generator().manual_seed(3))]
    head = tensors["lm_head.weight"]
    head[hot] = head[tau].clone()  # head'[hot[i]] = head[tau[i]]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    # Greedy picks the row that was head[pi(x)], now at hot[i] where tau[i] == pi(x).
    tau_inverse = {int(t): int(h) for h, t in zip(hot, tau)}
    pi = {a: b for chain in (perm.chain, perm.low_chain) for a, b in zip(chain, chain[1:])}
    assert set(pi) == set(hot.tolist())  # the chains cover the hot set
    return str(target), {x: tau_inverse[pi[x]] for x in pi}


@pytest.mark.server
def test_weight_update_from_disk_refreshes_the_hot_head_of_a_server(perm, start_server, tmp_path):
    new_target, new_step = permuted_target(perm, tmp_path)
    prompt = list(perm.chain[:3])
    new_greedy = [new_step[prompt[-1]]]
    while len(new_greedy) < 24:
        new_greedy.append(new_step[new_greedy[-1]])
    assert new_greedy != list(perm.chain[3:27])  # the update really changes the model

    server = start_server(perm, 2, perm.token_map("hot"))
    assert server.generate(prompt, 24)["meta_info"]["spec_accept_length"] == 3.0
    update = server.post("/update_weights_from_disk", {"model_path": new_target})
    assert update["success"], update
    out = server.generate(prompt, 24)
    assert out["output_ids"] == new_greedy
    # A stale hot head would still draft the old pi(x) and almost never be accepted.
    assert out["meta_info"]["spec_accept_length"] == 3.0


@pytest.mark.multirank
def test_swaps_after_an_update_that_replaces_the_head_tensor_read_the_new_rows():
    """An update may hand the head a new tensor (a new Parameter, or new storage under the same
    one) rather than copy into it; the refresh reads the new rows, and so must the adaptive map's
    later swaps. On a real gloo group at TP=2, balanced layout, ids of both shards swapped in: each
    rank's head equals the independent ``W_new[hot ids]`` of its slice, for a vocab-parallel head
    and for Gemma 3's replicated table."""
    vocab, hidden = 1000, 16
    half = vocab_shard_ranges(vocab, 2)[1][0]
    hot = [*range(0, half, 3)][:12] + [*range(half, vocab, 3)][:12]
    committed = [half + 1, half + 5, 2, 4]  # two ids from each shard, outside the map
    payload = {"vocab": vocab, "hidden": hidden, "hot": hot, "committed": committed}
    results = run_tp_group(rank_cases_adapt.adapter_after_replaced_weights, 2, payload)
    new_full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1))
    for case in ("vocab_parallel", "replicated"):
        hot_ids = results[0][case]["hot_ids"]
        assert set(committed) <= set(hot_ids.tolist()), case  # all four swapped in
        for result in results:
            got = result[case]
            assert torch.equal(got["hot_ids"], hot_ids) and got["swapped"] == 4, case
            first, count = got["columns"]
            assert torch.equal(got["head"][:count], new_full[hot_ids[first : first + count]]), (
                case,
                result["rank"],
            )
