"""Prefill/decode disaggregation with sglang-frspec on either or both nodes: the hot indices a
prefill node ships are read as the same token ids by the decode node (SGLang's own metadata
buffer and draft-input code, in real SGLang processes with and without the plugin's hooks)."""

from __future__ import annotations

import pytest

from tests import rank_cases_pd
from tests.harness.releases import pd_builds_first_proposal
from tests.harness.tp_group import run_tp_group

pytestmark = [pytest.mark.multirank, pytest.mark.every_release]

VOCAB = 1000
# FR-Spec's list format: unsorted, EOS (2) repeated; 8 entries, 6 distinct ids.
FILE_IDS = [2, 300, 5, 9, 5, 17, 2, 40]
HOT = sorted(set(FILE_IDS))
# Another node's maps: two more ids at the end (so FILE_IDS is the shorter map), and the same ids
# sorted (as the adapted map the docs recommend saving is, or `sorted(set(ids))`).
LONGER = [*FILE_IDS, 500, 600]
REORDERED = HOT
# Each node's first draft top-k (topk 2) for two requests, in its own hot order: stock picks file
# positions (6 and 7 are >= the 6 distinct ids), the plugin canonical indices.
STOCK_PICKED = [[7, 1], [6, 3]]
PLUGIN_PICKED = [[5, 0], [3, 1]]
# Positions 8, 9 lie beyond FILE_IDS; 6 and 0 both hold id 2 (stock drafts a repeated id twice).
LONGER_STOCK_PICKED = [[9, 8], [1, 0], [0, 9], [6, 0]]
LONGER_PLUGIN_PICKED = [[7, 6], [5, 0]]  # canonical: 600, 500 | 300, 2
PD_NODE = {"disaggregation_mode": "decode", "speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2,
           "speculative_num_steps": 2, "speculative_num_draft_tokens": 4}  # fmt: skip
MISMATCH = "[sglang-frspec] prefill/decode: the prefill node's token map differs from this decode node's"


def _node(perm, plugin: bool, steps: list) -> list[dict]:
    payload = {"vocab": VOCAB, "plugin": plugin, "steps": steps}
    (answers,) = run_tp_group(rank_cases_pd.pd_node, 1, payload,
                              server_args=PD_NODE | {"speculative_draft_model_path": perm.draft})  # fmt: skip
    return answers


@pytest.fixture(scope="module")
def nodes(perm) -> tuple[list[dict], list[dict], list[dict]]:
    """Three processes: stock prefill nodes, plugin nodes (receiving the stock wires and sending
    their own), stock decode nodes (receiving the plugin's)."""
    stock = _node(
        perm, False, [("prefill", STOCK_PICKED, FILE_IDS), ("prefill", LONGER_STOCK_PICKED, LONGER)]
    )
    plugin = _node(perm, True, [
        ("decode", stock[0]["wire"], FILE_IDS),  # 0: stock -> plugin
        ("prefill", PLUGIN_PICKED, FILE_IDS),  # 1
        ("decode", 1, FILE_IDS),  # 2: plugin -> plugin
        ("decode", stock[1]["wire"], FILE_IDS),  # 3: stock with a longer map -> plugin
        ("decode", stock[1]["wire"], FILE_IDS),  # 4: again
        ("prefill", LONGER_PLUGIN_PICKED, LONGER),  # 5
        ("decode", 5, FILE_IDS),  # 6: plugin with a longer map -> plugin
        ("decode", 1, REORDERED),  # 7: plugin -> plugin with the same ids sorted
        ("decode_rejection", 1, FILE_IDS),  # 8: plugin -> plugin under rejection sampling
        ("decode_rejection", stock[0]["wire"], FILE_IDS),  # 9: stock -> plugin, the same
        ("decode_rejection", stock[1]["wire"], FILE_IDS),  # 10: stock with a longer map -> plugin, the same
        ("decode_overlap", 1, FILE_IDS),  # 11: plugin -> plugin under the overlap scheduler
        ("decode_overlap", stock[0]["wire"], FILE_IDS),  # 12: stock -> plugin, the same
        ("decode_overlap", stock[1]["wire"], FILE_IDS),  # 13: stock with a longer map -> plugin, the same
        ("decode_rejection_overlap", 1, FILE_IDS),  # 14: 8 under the overlap scheduler
    ])  # fmt: skip
    stock_decode = _node(perm, False, [("decode", plugin[1]["wire"], FILE_IDS),
                                       ("decode", stock[0]["wire"], FILE_IDS),
                                       ("decode_overlap", stock[0]["wire"], FILE_IDS)])  # fmt: skip
    return stock, plugin, stock_decode


def test_stock_and_plugin_nodes_agree_on_the_drafted_tokens_in_every_direction(nodes):
    (stock_prefill, _), plugin, (stock_decode, stock_to_stock, _) = nodes
    plugin_decode, plugin_prefill, plugin_to_plugin = plugin[:3]
    assert stock_prefill["tokens"] == [[40, 300], [2, 9]]
    # Stock prefill -> plugin decode: stock's file positions (some >= H) read as the same tokens.
    assert plugin_decode == {"tokens": stock_prefill["tokens"], "warnings": []}
    # The plugin prefill ships stock's order: file positions of the canonical picks, and its map's
    # tag (negative: never a position) in the row's last slot, where stock leaves zeros.
    assert plugin_prefill["tokens"] == [[HOT[5], HOT[0]], [HOT[3], HOT[1]]]
    assert [[FILE_IDS[p] for p in row[:2]] for row in plugin_prefill["wire"]] == plugin_prefill["tokens"]
    tags = [row[-1] for row in plugin_prefill["wire"]]
    assert tags[0] < 0 and tags == [tags[0]] * 2 and [row[-1] for row in stock_prefill["wire"]] == [0, 0]
    assert plugin_to_plugin == {"tokens": plugin_prefill["tokens"], "warnings": []}
    # Plugin prefill -> stock decode (the tag unread), and stock -> stock unchanged.
    assert stock_decode == {"tokens": plugin_prefill["tokens"], "warnings": []}
    assert stock_to_stock == {"tokens": stock_prefill["tokens"], "warnings": []}


def test_a_decode_node_with_a_shorter_map_drafts_distinct_map_ids_and_warns_once(nodes):
    """A stock prefill node (no tag) whose map is longer sends positions beyond the decode node's
    map: those draft the map's first ids that their row does not hold, in range (no IndexError: a
    device assert on CUDA), so a request's sibling drafts stay distinct (the target-only tree
    verify commits a token drafted twice with twice its probability); so do two positions of one
    id. The others are read as usual; one warning names the cause and the fix. Under rejection
    sampling the first verify's q is one-hot at the token drafted in their place."""
    (_, longer_stock_prefill), plugin, _ = nodes
    assert longer_stock_prefill["tokens"] == [[600, 500], [300, 2], [2, 600], [2, 2]]
    first, again, rejection = plugin[3], plugin[4], plugin[10]
    # FILE_IDS in file order: 2, 300, ... (2 is position 0, FR-Spec's most frequent id).
    assert first["tokens"] == again["tokens"] == [[2, 300], [300, 2], [2, 300], [2, 300]]
    (warning,) = first["warnings"]
    assert "received 3 hot index(es) beyond this node's token map of 8 entries" in warning
    assert "the prefill node loaded a longer map and sent no map tag (stock SGLang" in warning
    assert "replaced by this map's first ids that their request does not already draft" in warning
    assert "sampled ones keep the target's distribution" in warning
    assert rejection["tokens"] == first["tokens"]
    assert rejection["proposal"] == first_proposal(first["tokens"])
    assert "Load the same --speculative-token-map file on every node" in warning
    assert again["warnings"] == []


def test_plugin_nodes_with_different_maps_fail_loudly(nodes):
    """Plugin to plugin, a map of other length or the same ids in another order would draft other
    tokens: the decode node refuses the tagged rows, naming the problem and the fix."""
    _, plugin, _ = nodes
    longer_prefill, from_longer, to_reordered = plugin[5], plugin[6], plugin[7]
    assert longer_prefill["tokens"] == [[600, 500], [300, 2]]
    assert longer_prefill["wire"][0][-1] not in (0, plugin[1]["wire"][0][-1])  # another map's tag
    for answer, entries in ((from_longer, len(FILE_IDS)), (to_reordered, len(REORDERED))):
        assert answer["error"].startswith(f"TokenMapError: {MISMATCH}")
        assert f"here, for this node's file of {entries} entries" in answer["error"]
        assert "the same ids in another order (e.g. a sorted or adapted map" in answer["error"]
        assert "Copy one map file to every prefill and decode node" in answer["error"]
        assert answer["warnings"] == []


def test_rejection_sampling_decode_proposes_the_drafted_token_with_probability_one(nodes):
    """Under rejection sampling a decode node's first verify reads q one-hot at each received draft
    (stock's ``pd_first_draft_proposal``: the prefill node ships drafts, not q). With a map the
    plugin builds it over the hot columns, so the draft lays it over the vocab with its later steps'
    rows: one at the first drafted token id, from a plugin or a stock prefill node."""
    (stock_prefill, _), plugin, _ = nodes
    for answer, sent in ((plugin[8], plugin[1]), (plugin[9], stock_prefill)):
        assert "error" not in answer, answer["error"]
        assert answer["tokens"] == sent["tokens"]
        assert answer["proposal"] == first_proposal(sent["tokens"])


def first_proposal(tokens: list[list[int]]) -> list | None:
    """The decode node's first q as the rank case reads it: one at each row's first draft, or None
    where the release's builder makes no q."""
    return [[(row[0], 1.0)] for row in tokens] if pd_builds_first_proposal() else None


def test_under_the_overlap_scheduler_the_next_forward_reads_the_translated_drafts(nodes):
    """With the overlap scheduler (on by default on GPUs) SGLang's builder stashes the decode node's
    first draft input in its ``FutureMap`` before returning, and the next forward reads the stash
    back (``resolve_forward_inputs``): the stash holds the plugin's translation (canonical hot
    indices, distinct per row; under rejection sampling q over the H hot columns, which also sizes
    the relay's q buffer), so every direction drafts what it does without overlap."""
    (stock_prefill, _), plugin, (_, _, stock_overlap) = nodes
    assert plugin[11] == {"tokens": plugin[1]["tokens"], "warnings": []}
    assert plugin[12] == {"tokens": stock_prefill["tokens"], "warnings": []}
    assert plugin[13]["tokens"] == plugin[3]["tokens"] == [[2, 300], [300, 2], [2, 300], [2, 300]]
    rejection = plugin[14]
    if first_proposal(plugin[1]["tokens"]) is not None:
        assert rejection["q width"] == len(HOT)  # H, not the vocab
    assert rejection["tokens"] == plugin[1]["tokens"]
    assert rejection["proposal"] == first_proposal(plugin[1]["tokens"])
    assert stock_overlap == {"tokens": stock_prefill["tokens"], "warnings": []}  # stock's own reading
