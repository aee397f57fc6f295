"""The adaptive hot set on real servers: the map follows what the target commits, in place."""

from __future__ import annotations

import os
import re

import pytest
import torch

from sglang_frspec.core.options import ADAPT_ENV, ADAPT_INTERVAL_ENV, COUNTS_ENV, LAYOUT_ENV
from tests.test_coverage import simulated_verify, wait_for

pytestmark = pytest.mark.server
START, NEW, SAME_REQUESTS = 0, 40, 4
ADDRESSES = re.compile(r"hot_token_id at (0x[0-9a-f]+), hot head at (0x[0-9a-f]+)")
DECISION = re.compile(
    r"map adapted after \d+ verify steps: (\d+) id\(s\) in .* \(in place at (0x[0-9a-f]+), (0x[0-9a-f]+)\)"
)


@pytest.mark.parametrize(("tp", "layout"), [(1, "balanced"), (2, "local"), (3, "local")])
def test_the_map_takes_in_the_committed_tokens_it_missed(perm, start_server, tmp_path, tp, layout):
    """A map holding half the fixture's hot ids: the chain's tokens outside it are swapped in while
    serving (one decision per verify step), on every rank (a rank that kept the old ids would
    compute other columns and the drafts would fail), after which the same request verifies in
    as many steps as a simulation of the new map gives: fewer. Outputs stay greedy throughout."""
    counts_path = tmp_path / "served.counts.pt"
    token_map = perm.token_map("hot_half")
    env = {ADAPT_ENV: "1", ADAPT_INTERVAL_ENV: "1", LAYOUT_ENV: layout, COUNTS_ENV: str(counts_path)}
    server = start_server(perm, tp, token_map, env=env)
    prompt, expected = list(perm.chain[START : START + 3]), list(perm.chain[START + 3 : START + 3 + NEW])
    before = server.generate([prompt] * SAME_REQUESTS, NEW)  # each token committed 4 times a step
    assert [out["output_ids"] for out in before] == [expected] * SAME_REQUESTS
    adapted_path = f"{counts_path}.map.pt"
    wait_for(lambda: os.path.exists(adapted_path))  # written once the server is idle
    adapted = set(torch.load(adapted_path).tolist())
    original = set(torch.load(token_map).tolist())
    assert len(adapted) == len(original)  # H never changes
    committed = set(perm.chain[START + 4 : START + 3 + NEW])
    assert committed - original and committed <= adapted  # what it missed is in the map now
    after = server.generate(prompt, NEW)
    assert after["output_ids"] == expected
    # While the map adapts, an id it holds but has not yet seen committed can leave it just before
    # it is needed: the first requests are not compared with anything but greedy.
    static_steps = simulated_verify(perm, START, before[0], original)[1]  # had the map stayed
    adapted_steps = simulated_verify(perm, START, after, adapted)[1]
    assert after["meta_info"]["spec_verify_ct"] == adapted_steps < static_steps
    log = server.log()
    (start_addresses,) = ADDRESSES.findall(log)
    decisions = DECISION.findall(log)
    assert decisions and all((h, w) == start_addresses for _, h, w in decisions)  # in place
    assert sum(int(n) for n, _, _ in decisions) >= len(committed - original)
