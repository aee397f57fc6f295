"""Prefill/decode disaggregation with sglang-frspec on either or both nodes: the hot indices a
prefill node ships are read as the same token ids by the decode node (SGLang's own metadata
buffer and draft-input code, in real SGLang processes with and without the plugin's hooks)."""

from __future__ import annotations

import pytest

from tests import rank_cases_pd
from tests.harness.tp_group import run_tp_group

pytestmark = pytest.mark.multirank

VOCAB = 1000
# FR-Spec's list format: unsorted, EOS (2) repeated; 8 entries, 6 distinct ids.
FILE_IDS = [2, 300, 5, 9, 5, 17, 2, 40]
HOT = sorted(set(FILE_IDS))
# Each node's first draft top-k (topk 2) for two requests, in its own hot order: stock picks file
# positions (6 and 7 are >= the 6 distinct ids), the plugin canonical indices.
STOCK_PICKED = [[7, 1], [6, 3]]
PLUGIN_PICKED = [[5, 0], [3, 1]]
PD_NODE = {"disaggregation_mode": "decode", "speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2,
           "speculative_num_steps": 2, "speculative_num_draft_tokens": 4}  # fmt: skip


def _node(perm, plugin: bool, steps: list) -> list[dict]:
    payload = {"file_ids": FILE_IDS, "vocab": VOCAB, "plugin": plugin, "steps": steps}
    (answers,) = run_tp_group(rank_cases_pd.pd_node, 1, payload,
                              server_args=PD_NODE | {"speculative_draft_model_path": perm.draft})  # fmt: skip
    return answers


def test_stock_and_plugin_nodes_agree_on_the_drafted_tokens_in_every_direction(perm):
    (stock_prefill,) = _node(perm, False, [("prefill", STOCK_PICKED)])
    assert stock_prefill["tokens"] == [[40, 300], [2, 9]]
    plugin_decode, plugin_prefill, plugin_to_plugin = _node(
        perm, True, [("decode", stock_prefill["wire"]), ("prefill", PLUGIN_PICKED), ("decode", None)]
    )
    # Stock prefill -> plugin decode: stock's file positions (some >= H) read as the same tokens.
    assert plugin_decode == {"tokens": stock_prefill["tokens"]}
    # The plugin prefill ships stock's order: file positions of the canonical picks.
    assert plugin_prefill["tokens"] == [[HOT[5], HOT[0]], [HOT[3], HOT[1]]]
    assert [[FILE_IDS[p] for p in row[:2]] for row in plugin_prefill["wire"]] == plugin_prefill["tokens"]
    assert plugin_to_plugin == {"tokens": plugin_prefill["tokens"]}
    # Plugin prefill -> stock decode, and stock -> stock unchanged.
    stock_decode, stock_to_stock = _node(perm, False, [("decode", plugin_prefill["wire"]),
                                                      ("decode", stock_prefill["wire"])])  # fmt: skip
    assert stock_decode == {"tokens": plugin_prefill["tokens"]}
    assert stock_to_stock == {"tokens": stock_prefill["tokens"]}
