"""The adaptive hot set on real servers: the map follows what the target commits, in place."""

from __future__ import annotations

import os
import re

import pytest
import torch

from sglang_frspec.core import vocab_shard_ranges
from sglang_frspec.core.options import ADAPT_ENV, ADAPT_INTERVAL_ENV, COUNTS_ENV, LAYOUT_ENV
from tests.harness.draft_probe import draft_tensors, probed_launch
from tests.test_coverage import metric, simulated_verify, urllib_get, wait_for
from tests.test_weight_updates import permuted_target

pytestmark = pytest.mark.server
START, NEW, SAME_REQUESTS = 0, 40, 4
NEW_ACROSS_SHARDS = 20  # 4 commits stay ahead of none for 18 decisions; 20 tokens take about 13
COMMITTED = "sglang:frspec_committed_tokens_total"
IN_MAP = "sglang:frspec_committed_in_map_tokens_total"
SWAPS = "sglang:frspec_map_swaps_total"
DECISION = re.compile(
    r"map adapted after \d+ verify steps: (\d+) id\(s\) in .* \(in place at (0x[0-9a-f]+), (0x[0-9a-f]+)\)"
)


@pytest.mark.parametrize(
    ("tp", "layout", "map_name"),
    [(1, "balanced", "hot_half"), (2, None, "hot_low"), (2, "local", "hot_low"), (3, None, "hot_half")],
    ids=["tp1", "tp2-default-across-shards", "tp2-local-across-shards", "tp3-default"],
)
def test_the_map_takes_in_the_committed_tokens_it_missed(perm, start_server, tmp_path, tp, layout, map_name):
    """A map missing some of the chain's tokens: those are swapped in while serving (one decision
    per verify step), on every rank (a rank that kept the old ids would compute other columns and
    the drafts would fail), after which the same request verifies in as many steps as a
    simulation of the new map gives: fewer. Outputs stay greedy throughout. With the default
    layout (``None``: SGLANG_FRSPEC_LAYOUT unset, balanced) at TP 2 and 3. ``hot_low`` holds rank
    0's TP=2 shard only while the chain crosses into rank 1's: the traffic drifts across the shard
    boundary. The default layout follows it (rows sent across ranks); under ``local`` rank 1 has
    no hot position, so nothing can be swapped in and the map stays as it started."""
    counts_path = tmp_path / "served.counts.pt"
    token_map = perm.token_map(map_name)
    env = {ADAPT_ENV: "1", ADAPT_INTERVAL_ENV: "1", COUNTS_ENV: str(counts_path)}
    env |= {LAYOUT_ENV: layout} if layout else {}
    server = start_server(perm, tp, token_map, env=env, launch=probed_launch)
    # hot_low misses half the chain: a shorter run, so that the first ids it takes in are still
    # ahead of the never-committed ones when the last are taken (a score halves per decision).
    new = NEW if map_name == "hot_half" else NEW_ACROSS_SHARDS
    prompt, expected = list(perm.chain[START : START + 3]), list(perm.chain[START + 3 : START + 3 + new])
    before = server.generate([prompt] * SAME_REQUESTS, new)  # each token committed 4 times a step
    assert [out["output_ids"] for out in before] == [expected] * SAME_REQUESTS
    adapted_path = f"{counts_path}.map.pt"
    wait_for(lambda: os.path.exists(adapted_path))  # written once the server is idle
    adapted = set(torch.load(adapted_path).tolist())
    original = set(torch.load(token_map).tolist())
    assert len(adapted) == len(original)  # H never changes
    committed = set(perm.chain[START + 4 : START + 3 + new])
    missed = committed - original
    assert missed
    if map_name == "hot_low":  # the missed tokens are all in rank 1's TP=2 shard
        assert min(missed) >= vocab_shard_ranges(perm.vocab_size, 2)[1][0]
    after = server.generate(prompt, new)
    assert after["output_ids"] == expected
    # While the map adapts, an id it holds but has not yet seen committed can leave it just before
    # it is needed: the first requests are not compared with anything but greedy.
    static_steps = simulated_verify(perm, START, before[0], original)[1]  # had the map stayed
    adapted_steps = simulated_verify(perm, START, after, adapted)[1]
    decisions = DECISION.findall(server.log())
    if layout == "local" and map_name == "hot_low":  # the local layout cannot cross the boundary
        assert not decisions and adapted == original
        assert after["meta_info"]["spec_verify_ct"] == adapted_steps == static_steps
        return
    assert committed <= adapted  # what it missed is in the map now
    assert after["meta_info"]["spec_verify_ct"] == adapted_steps < static_steps
    assert sum(int(n) for n, _, _ in decisions) >= len(missed)
    assert_adapted_in_place(server, tp, adapted_path, original)


def assert_adapted_in_place(server, tp: int, adapted_path: str, original: set[int]) -> None:
    """What SGLang drafts with, read in each scheduler by the draft probe: once idle, every rank's
    draft worker holds the adapted map (the counts file's ``.map.pt``) in the ``hot_token_id``
    tensor it started with (the probe's first line, logged before the first request), and its
    draft model computes from the ``lm_head.weight`` it started with (captured graphs hold both)."""

    def settled() -> bool:
        lines, adapted = draft_tensors(server.log()), set(torch.load(adapted_path).tolist())
        return sorted(lines) == list(range(tp)) and all(set(s[-1].ids) == adapted for s in lines.values())

    wait_for(settled)
    adapted = set(torch.load(adapted_path).tolist())
    lines = draft_tensors(server.log())
    assert sorted(lines) == list(range(tp))
    for seen in lines.values():
        start, now = seen[0], seen[-1]
        assert set(start.ids) == original and set(now.ids) == adapted != original
        addresses = {(s.hot_token_id_at, s.lm_head_at) for s in seen}
        assert addresses == {(start.hot_token_id_at, start.lm_head_at)}


def _verify_steps(output_ids: list[int], hot: set[int], steps: int = 2) -> int:
    """Verify steps of one greedy request on a permutation model (drafts share the target's
    head): a step accepts the leading tokens still to come that the map holds (at most ``steps``)
    and commits the next one; the prefill gave the first token."""
    tokens, i, count = output_ids[1:], 0, 0
    while i < len(tokens):
        drafted = 0
        while drafted < steps and i + drafted < len(tokens) and tokens[i + drafted] in hot:
            drafted += 1
        i += drafted + 1
        count += 1
    return count


def test_a_weight_update_while_adapting_refreshes_the_current_set(perm, start_server, tmp_path):
    """TP=2: swaps happen, then /update_weights_from_disk loads a target whose head rows are
    permuted inside the fixture's hot set (a new greedy path). The refresh must rebuild the
    hot head for the ids the map holds now (not the start-up ones) from the new weights, and
    later swaps must read new rows: once the map holds the new path, a request verifies in as
    many steps as a simulation of that map gives. A head left stale, or rebuilt for the
    start-up ids, drafts other tokens and takes more steps."""
    counts_path = tmp_path / "served.counts.pt"
    adapted_path = f"{counts_path}.map.pt"
    token_map = perm.token_map("hot_half")
    env = {ADAPT_ENV: "1", ADAPT_INTERVAL_ENV: "1", LAYOUT_ENV: "local", COUNTS_ENV: str(counts_path)}
    server = start_server(perm, 2, token_map, env=env, extra=("--enable-metrics",), launch=probed_launch)
    prompt = list(perm.chain[START : START + 3])
    server.generate([prompt] * SAME_REQUESTS, NEW)
    assert DECISION.findall(server.log())  # swaps happened before the update
    new_target, new_step = permuted_target(perm, tmp_path)
    update = server.post("/update_weights_from_disk", {"model_path": new_target})
    assert update["success"], update
    expected = [new_step[prompt[-1]]]
    while len(expected) < NEW:
        expected.append(new_step[expected[-1]])
    for _ in range(4):  # serve the new path until a batch makes no decision: the map has settled
        decisions = len(DECISION.findall(server.log()))
        mtime = os.path.getmtime(adapted_path) if os.path.exists(adapted_path) else 0.0
        outs = server.generate([prompt] * SAME_REQUESTS, NEW)  # one commit a step is below the margin
        assert [out["output_ids"] for out in outs] == [expected] * SAME_REQUESTS
        if len(DECISION.findall(server.log())) == decisions:
            break
    else:
        pytest.fail("the map still changed at every batch")
    wait_for(lambda: os.path.exists(adapted_path) and os.path.getmtime(adapted_path) > mtime)
    settled = set(torch.load(adapted_path).tolist())
    assert set(expected[1:]) <= settled  # the new path is in the map (all of it: H/4 swaps allowed)
    assert [out["meta_info"]["spec_verify_ct"] for out in outs] == [
        _verify_steps(expected, settled)
    ] * SAME_REQUESTS
    assert _verify_steps(expected, settled) < _verify_steps(expected, set(torch.load(token_map).tolist()))
    assert_adapted_in_place(server, 2, adapted_path, set(torch.load(token_map).tolist()))
    # --enable-metrics: every swap is exported once. (The in-map counter's fall under swaps, which
    # made Counter.inc raise, needs ids with large counts to leave a full map: test_coverage.py.)
    swaps = sum(int(n) for n, _, _ in DECISION.findall(server.log()))
    wait_for(lambda: [v for _, v in metric(urllib_get(server.url + "/metrics"), SWAPS)] == [swaps])
    text = urllib_get(server.url + "/metrics")
    assert [v for _, v in metric(text, SWAPS)] == [swaps]
    (in_map,), (committed,) = ([v for _, v in metric(text, name)] for name in (IN_MAP, COMMITTED))
    assert 0 < in_map < committed
