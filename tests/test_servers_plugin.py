"""Real TP servers with EAGLE + token map + this plugin, on the permutation fixture."""

from __future__ import annotations

import pytest

from sglang_frspec.testing.fixtures import random_fixture

pytestmark = pytest.mark.server
NEW = 24


def generate_chains(server, chain, starts=(0, 17, 33)) -> list[float]:
    """Greedy batch from several points of a pi chain; asserts the outputs, returns accept lengths."""
    outs = server.generate([list(chain[s : s + 3]) for s in starts], NEW)
    for s, out in zip(starts, outs):
        assert out["output_ids"] == list(chain[s + 3 : s + 3 + NEW])
    return [out["meta_info"]["spec_accept_length"] for out in outs]


@pytest.mark.parametrize(
    ("map_name", "chain", "layout", "exchange"),
    [
        ("hot", "chain", "local", "full"),  # crashes stock in init_lm_head
        ("hot", "chain", "balanced", "full"),
        ("hot_low", "low_chain", "local", "full"),  # crashes stock at the first request
        ("hot_low", "low_chain", "balanced", "topk"),
        ("hot_list", "chain", "local", "topk"),  # FR-Spec's own format: a list, EOS repeated
    ],
)
def test_tp2_token_map_follows_pi_with_full_acceptance(perm, start_server, map_name, chain, layout, exchange):
    env = {"SGLANG_FRSPEC_LAYOUT": layout, "SGLANG_FRSPEC_EXCHANGE": exchange}
    server = start_server(perm, 2, perm.token_map(map_name), env=env)
    assert generate_chains(server, getattr(perm, chain)) == [3.0, 3.0, 3.0]  # as at TP=1
    log = server.log_path.read_text()
    assert f"layout={layout} exchange={exchange}" in log
    if map_name == "hot_list":
        assert "repeats 1 id(s)" in log  # one warning for FR-Spec's repeated EOS


def test_tp1_matches_stock_and_tp2_matches_tp1(perm, start_server):
    """Same tokens, accept lengths and verify steps as stock SGLang at TP=1, for a map covering
    the chain (full acceptance) and one covering half of it (partial); TP=2 then equals TP=1."""
    seen = {}
    for tp, plugin in ((1, False), (1, True), (2, True)):
        for map_name in ("hot", "hot_half"):
            if tp == 2 and map_name == "hot":
                continue  # covered above
            server = start_server(perm, tp, perm.token_map(map_name), plugin=plugin)
            outs = server.generate([list(perm.chain[s : s + 3]) for s in (0, 40)], NEW)
            seen[tp, plugin, map_name] = [
                (o["output_ids"], o["meta_info"]["spec_accept_length"], o["meta_info"]["spec_verify_ct"])
                for o in outs
            ]
            server.stop()
    for map_name in ("hot", "hot_half"):
        assert seen[1, True, map_name] == seen[1, False, map_name]
    assert [out[0] for out in seen[1, True, "hot"]] == [
        list(perm.chain[s + 3 : s + 3 + NEW]) for s in (0, 40)
    ]
    assert [out[1] for out in seen[1, True, "hot"]] == [3.0, 3.0]
    partial = [out[1] for out in seen[1, True, "hot_half"]]
    assert all(1.0 < a < 3.0 for a in partial)
    assert seen[2, True, "hot_half"] == seen[1, True, "hot_half"]


def test_tp2_random_weights_match_plain_decoding(start_server):
    """Random weights (no structure to lean on): EAGLE + map at TP=2 decodes exactly as plain."""
    fixture = random_fixture()
    prompts = [[5, 77, 1203], [31000, 17], [9, 9, 9, 9, 12000]]
    plain = start_server(fixture, 2, eagle=False)
    expected = [o["output_ids"] for o in plain.generate(prompts, NEW)]
    plain.stop()
    server = start_server(fixture, 2, fixture.token_map("hot"))
    assert [o["output_ids"] for o in server.generate(prompts, NEW)] == expected


def test_tp2_plugin_without_map_is_unchanged(perm, start_server):
    server = start_server(perm, 2)
    assert generate_chains(server, perm.chain) == [3.0, 3.0, 3.0]
    assert "sglang-frspec:" not in server.log_path.read_text()
