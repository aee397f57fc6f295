"""EAGLE3 + --speculative-token-map at TP=2: the plugin keeps upstream SGLang's behaviour.

EAGLE3 drafts ship their own reduced vocab (``d2t``), so SGLang ignores the map with a warning
and the plugin only adds its own warning: no hot head is built. The draft's copy path predicts
pi(x) through d2t (see ``eagle3_fixture``), so full acceptance also shows that the d2t ids
reach the drafted tokens intact under TP=2.
"""

from __future__ import annotations

import pytest

from sglang_frspec.demo.cpu import eagle_args
from tests.harness.eagle3_fixture import eagle3_draft

pytestmark = pytest.mark.server
NEW = 24
STARTS = (0, 17, 33)
SGLANG_WARNING = "Speculative token map specified, but EAGLE3 models already have this"
PLUGIN_WARNING = "--speculative-token-map is ignored for EAGLE3"


@pytest.fixture(scope="session")
def eagle3(perm) -> str:
    """The EAGLE3 draft for the permutation fixture (1024-id draft vocab holding the hot set)."""
    return eagle3_draft(perm)


def eagle3_args(draft: str, token_map: str) -> list[str]:
    return eagle_args(draft, token_map, algorithm="EAGLE3")


def check_eagle3_server(server, chain) -> str:
    """Greedy outputs follow pi with full acceptance; returns the server log."""
    outs = server.generate([list(chain[s : s + 3]) for s in STARTS], NEW)
    for s, out in zip(STARTS, outs):
        assert out["output_ids"] == list(chain[s + 3 : s + 3 + NEW])  # plain greedy decoding
    # 3.0 = num_steps + 1: every drafted token accepted, as stock does at TP=1 and TP=2.
    assert [out["meta_info"]["spec_accept_length"] for out in outs] == [3.0] * len(STARTS)
    log = server.log_path.read_text()
    assert "type=LlamaForCausalLMEagle3" in log  # the EAGLE3 draft really was loaded
    assert SGLANG_WARNING in log
    assert "sglang-frspec:" not in log  # no hot head: the map never reached the plugin's worker
    return log


def test_tp2_eagle3_ignores_token_map_with_plugin(perm, eagle3, start_server):
    server = start_server(perm, 2, eagle=False, extra=eagle3_args(eagle3, perm.token_map("hot")))
    log = check_eagle3_server(server, perm.chain)
    assert PLUGIN_WARNING in log


@pytest.mark.stock
def test_stock_tp2_eagle3_ignores_token_map(perm, eagle3, start_server):
    """The upstream behaviour the plugin keeps (this plugin excluded through SGLANG_PLUGINS)."""
    server = start_server(
        perm, 2, plugin=False, eagle=False, extra=eagle3_args(eagle3, perm.token_map("hot"))
    )
    log = check_eagle3_server(server, perm.chain)
    assert PLUGIN_WARNING not in log
