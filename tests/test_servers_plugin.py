"""Real TP servers with EAGLE + token map + this plugin, on the permutation fixture."""

from __future__ import annotations

import pytest

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


def test_tp1_with_plugin_matches_stock(perm, start_server):
    """Same tokens and the same acceptance as stock SGLang, for a hot and a disjoint map."""
    seen = {}
    for plugin in (False, True):
        for map_name in ("hot", "cold"):
            server = start_server(perm, 1, perm.token_map(map_name), plugin=plugin)
            out = server.generate(list(perm.chain[:3]), NEW)
            seen[plugin, map_name] = (out["output_ids"], out["meta_info"]["spec_accept_length"])
            server.stop()
    assert seen[True, "hot"] == seen[False, "hot"] == (list(perm.chain[3 : 3 + NEW]), 3.0)
    assert seen[True, "cold"] == seen[False, "cold"]
    assert seen[True, "cold"][1] < 1.5  # a map disjoint from the chain drafts nothing useful


def test_tp2_plugin_without_map_is_unchanged(perm, start_server):
    server = start_server(perm, 2)
    assert generate_chains(server, perm.chain) == [3.0, 3.0, 3.0]
    assert "sglang-frspec:" not in server.log_path.read_text()
