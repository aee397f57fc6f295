"""Every branch of check_head_supported, describe_head_shard and check_draft_supported, on real
SGLang ParallelLMHead objects and real draft configs; each message names the problem and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sglang_frspec.core import UnsupportedSetupError, vocab_shard_ranges
from tests import rank_cases_adapters
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_adapters import skewed_ids

VOCAB, HIDDEN = 1000, 64


@pytest.fixture
def single_rank():
    """SGLang's parallel context for one rank (heads are built unsharded)."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, tp_size=1):
        yield


def _head(**kwargs):
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    return ParallelLMHead(VOCAB, HIDDEN, **kwargs)


def _rejection(module) -> str:
    from sglang_frspec.adapters.head import check_head_supported

    with pytest.raises(UnsupportedSetupError) as info:
        check_head_supported(module)
    return str(info.value)


def test_plain_heads_are_accepted_and_unsharded_at_tp1(single_rank):
    from sglang_frspec.adapters.head import check_head_supported, describe_head_shard

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        head = _head(params_dtype=dtype)
        check_head_supported(head)
        shard = describe_head_shard(head)
        assert (shard.group_name, shard.rank, shard.shard_ranges, shard.vocab_size) == (
            None, 0, ((0, VOCAB),), VOCAB,
        )  # fmt: skip
        assert shard.all_gather is None  # nothing to exchange at tp 1


def test_gguf_quantized_head_names_quantization_and_the_fix(single_rank):
    from sglang.srt.layers.quantization.gguf import GGUFConfig

    head = _head(quant_config=GGUFConfig())
    assert not hasattr(head, "weight")  # GGUF keeps qweight/qweight_type instead
    message = _rejection(head)
    assert "the target LM head is quantized (GGUFEmbeddingMethod) and holds qweight, qweight_type" in message
    assert "a GGUF head, whose layout is not read back" in message
    assert "Serve a checkpoint whose lm_head is left unquantized" in message
    assert "drop --speculative-token-map" in message


def test_head_without_a_weight_is_rejected(single_rank):
    head = _head()
    del head.weight  # what set_embed_and_head does before it assigns a shared tensor
    message = _rejection(head)
    assert "has no 'weight' tensor, so its rows cannot be sliced" in message
    assert "without --speculative-token-map" in message


def test_gguf_typed_weight_is_rejected_as_packed(single_rank):
    from sglang.srt.utils import set_weight_attrs

    head = _head()
    # The attribute GGUF's create_weights sets on its packed parameters (gguf.py).
    set_weight_attrs(head.weight, {"is_gguf_weight_type": True})
    message = _rejection(head)
    assert "packed (GGUF or CPU AMX/VNNI layout)" in message
    assert "Use a safetensors checkpoint (not --load-format gguf)" in message


def test_amx_packed_weight_is_rejected_as_packed(single_rank):
    head = _head(params_dtype=torch.bfloat16)
    # What SGLang's _amx_process_weight_after_loading sets on an AMX CPU (none here).
    head.use_intel_amx_backend = True
    message = _rejection(head)
    assert "packed (GGUF or CPU AMX/VNNI layout)" in message and "cannot be sliced" in message


def test_amx_cpu_bf16_head_is_reported_as_amx_packed_not_quantized(single_rank, monkeypatch):
    from sglang.srt.layers import vocab_parallel_embedding

    # SGLang's own module flags as computed on a CPU with AMX (this machine has none).
    monkeypatch.setattr(vocab_parallel_embedding, "_is_cpu", True)
    monkeypatch.setattr(vocab_parallel_embedding, "_is_cpu_amx_available", True)
    head = _head(params_dtype=torch.bfloat16)
    assert type(head.quant_method).__name__ == "PackWeightMethod"
    message = _rejection(head)
    assert "AMX" in message and "quantized" not in message


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_wrong_dtype_head_names_the_dtype(single_rank, dtype):
    message = _rejection(_head(params_dtype=dtype))
    assert f"the target LM head weight is {dtype} with shape ({VOCAB + 24}, {HIDDEN})" in message
    assert "needs a plain 2-D fp16/bf16/fp32 head" in message and "Drop --speculative-token-map" in message


def test_head_weight_that_is_not_2d_is_rejected(single_rank):
    head = _head()
    rows = head.weight.shape[0]
    # A re-laid-out (e.g. blocked) copy of the same rows.
    head.weight = torch.nn.Parameter(head.weight.data.reshape(rows, HIDDEN // 16, 16), requires_grad=False)
    message = _rejection(head)
    assert f"shape ({rows}, {HIDDEN // 16}, 16)" in message and "plain 2-D" in message


def test_head_with_other_columns_than_the_hidden_size_is_rejected(single_rank):
    head = _head()
    head.weight = torch.nn.Parameter(head.weight.data[:, : HIDDEN // 2].clone(), requires_grad=False)
    message = _rejection(head)
    assert f"has {HIDDEN // 2} columns but the hidden size is {HIDDEN}" in message
    assert "cannot be sliced by token id" in message and "Drop --speculative-token-map" in message


def test_head_with_other_local_rows_than_its_shard_is_rejected(single_rank):
    head = _head()
    shard_rows = head.num_embeddings_per_partition
    head.weight = torch.nn.Parameter(head.weight.data[: shard_rows // 2].clone(), requires_grad=False)
    message = _rejection(head)
    assert f"has {shard_rows // 2} local rows but its vocab shard has {shard_rows}" in message
    assert "cannot be sliced by token id" in message and "Drop --speculative-token-map" in message


@pytest.mark.multirank
def test_head_shards_on_real_tp_and_attn_tp_groups():
    """tp 4 with 2 DP-attention ranks and --enable-dp-lm-head: tp and attn_tp groups both exist."""
    results = run_tp_group(
        rank_cases_adapters.head_shard_cases,
        4,
        {"vocab": VOCAB, "hidden": HIDDEN},
        server_args={"enable_dp_attention": True, "dp_size": 2, "enable_dp_lm_head": True},
    )
    assert [(r["tp_rank"], r["attn_tp_rank"]) for r in results] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    for r in results:
        tp_rank, attn_rank = r["tp_rank"], r["attn_tp_rank"]
        assert r["tp"] == ("ok", "tp", tp_rank, vocab_shard_ranges(VOCAB, 4), True)
        assert r["attn_tp"] == ("ok", "attn_tp", attn_rank, vocab_shard_ranges(VOCAB, 2), True)
        assert r["replicated"] == ("ok", None, 0, ((0, VOCAB),), False)
        for case, group, rank, size in (("tp_other_rank", "tp", tp_rank, 4), ("attn_tp_other_rank",
                                        "attn_tp", attn_rank, 2)):  # fmt: skip
            kind, message = r[case]
            held = vocab_shard_ranges(VOCAB, size)[(rank + 1) % size]
            expected = list(vocab_shard_ranges(VOCAB, size)[rank])
            assert kind == "error", (case, r[case])
            assert f"rank {rank} of the {group} group holds vocab rows [{held[0]}, {held[1]})" in message
            assert f"not {expected} as its group position implies" in message
            assert "not supported with --speculative-token-map" in message


def _draft_config(perm, tmp_path, **fields):
    """The fixture's EAGLE draft config.json with ``fields`` set, read as SGLang reads it."""
    from sglang.srt.utils.hf_transformers.config import get_config

    draft = tmp_path / "draft"
    draft.mkdir()
    shutil.copy(f"{perm.draft}/config.json", draft / "config.json")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | fields))
    return get_config(str(draft), trust_remote_code=False)


def _check_draft(config, num_hot: int) -> None:
    from sglang_frspec.adapters.head import check_draft_supported

    draft = torch.nn.Module()
    draft.config = config  # check_draft_supported reads only the draft model's config
    check_draft_supported(draft, num_hot)


@pytest.mark.parametrize("field", ["draft_vocab_size", "hot_vocab_size"])
def test_draft_vocab_field_must_equal_the_hot_count(perm, tmp_path, field):
    num_hot = 1200
    with pytest.raises(UnsupportedSetupError) as info:
        _check_draft(_draft_config(perm, tmp_path, **{field: num_hot + 1}), num_hot)
    message = str(info.value)
    assert (
        f"the draft config sets {field}={num_hot + 1}, but the token map has {num_hot} distinct ids"
        in message
    )
    assert f"SGLang sizes draft buffers from {field}" in message
    assert f"Remove {field} from the draft's config.json or use a map of that size" in message


@pytest.mark.parametrize("field", ["draft_vocab_size", "hot_vocab_size"])
def test_draft_vocab_field_equal_to_the_hot_count_is_accepted(perm, tmp_path, field):
    _check_draft(_draft_config(perm, tmp_path, **{field: 1200}), 1200)


def test_untied_draft_without_vocab_fields_is_accepted(perm, tmp_path):
    config = _draft_config(perm, tmp_path)
    assert not config.tie_word_embeddings and not hasattr(config, "draft_vocab_size")
    _check_draft(config, 1200)


def test_tied_draft_is_rejected(perm, tmp_path):
    with pytest.raises(UnsupportedSetupError) as info:
        _check_draft(_draft_config(perm, tmp_path, tie_word_embeddings=True), 1200)
    message = str(info.value)
    assert "ties its LM head to its input embeddings (tie_word_embeddings" in message
    assert "Use an untied EAGLE draft, or drop --speculative-token-map" in message


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_building_the_hot_head_stays_within_its_memory_budget(tp):
    """Peak extra memory of building (and refreshing) the head <= the head + one chunk, under a
    skewed map at TP 2/4/8 (the old one-shot exchange held tp x max-owned rows at once), and the
    head holds exactly the reference rows."""
    vocab, hidden, num_hot, chunk = 128256, 256, 32768, 2 << 20
    hot = skewed_ids(vocab, num_hot)
    payload = {"vocab": vocab, "hidden": hidden, "map": hot, "chunk_bytes": chunk}
    results = run_tp_group(rank_cases_adapters.head_build_memory, tp, payload, timeout=600)
    owned = [sum(s <= i < e for i in hot) for s, e in vocab_shard_ranges(vocab, tp)]
    assert max(owned) > 1.5 * num_hot / tp  # the map is skewed: the case the budget is about
    slack = 256 << 10  # the plan's masks over the hot ids (a few bytes per hot id)
    for r, result in enumerate(results):
        assert [result[layout]["owned"] for layout in ("local", "balanced")] == [owned[r]] * 2
        for layout in ("local", "balanced"):
            got = result[layout]
            assert got["exact"], (r, layout)
            assert got["build"] <= got["head_bytes"] + chunk + slack, (r, layout, got)
            assert got["refresh"] <= chunk + slack, (r, layout, got)


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 3])
def test_head_sliced_from_a_replicated_table_gives_exact_hot_logits(tp):
    """Gemma 3 at TP > 1 (SGLang's own ``Gemma3ForCausalLM``): the head is each rank's row slice of
    an embedding table every rank holds whole. Under both layouts each rank takes its hot rows from
    the table by global id, with no collective at start-up or at a refresh; the draft logits are
    bit-identical on every rank and equal the single-rank reference for both exchanges."""
    vocab, hidden, rows, topk = 5003, 48, 5, 4  # hidden: a multiple of the 6 heads (divisible by tp)
    per_rank = -(-vocab // tp)  # Gemma 3's slices: no padding to 64, unlike a VocabParallelEmbedding
    ranges = tuple((min(r * per_rank, vocab), min((r + 1) * per_rank, vocab)) for r in range(tp))
    assert ranges != vocab_shard_ranges(vocab, tp)  # so a plan over SGLang's padded shards would fail
    last = ranges[-1][0]
    maps = {
        "skewed": skewed_ids(vocab, 600),
        "all_on_last": list(range(last, last + 77)),  # every rank but the last computes nothing locally
        "boundaries": [vocab - 1, *(i for s, e in ranges for i in (s, s + 1, e - 1)), 0, 0],
    }
    payload = {"vocab": vocab, "hidden": hidden, "rows": rows, "topk": topk, "maps": maps}
    results = run_tp_group(rank_cases_adapters.replicated_table_head, tp, payload)
    for rank, r in enumerate(results):
        assert (r["rank"], r["shard"], r["module"]) == (
            rank,
            ("tp", tp, ranges, True),
            "Gemma3TextScaledWordEmbedding",
        )
        assert r["whole"] == (None, 1, ((0, vocab),), True)  # a whole-table head is not sharded
        assert "no even slice of it over the tp or attn_tp group gives this rank those rows" in r["shifted"]
        assert "Serve this model without --speculative-token-map, or at --tp-size 1" in r["shifted"]
    for name, ids in maps.items():
        reference, updated = results[0][name]
        for layout in ("local", "balanced"):
            cases = [r[name, layout] for r in results]
            for case in cases:
                assert case["rows_exact"] and case["padding_zero"] and case["refresh_in_place"], (
                    name,
                    layout,
                )
                assert case["swapped_exact"], (name, layout)  # the adapter's reader: rows by global id
                assert case["build_collectives"] == case["refresh_collectives"] == 0, (name, layout)
            counts = cases[0]["counts"]
            if layout == "local":  # each rank computes the hot ids of its own slice
                assert list(counts) == [len({i for i in ids if s <= i < e}) for s, e in ranges]
            else:
                assert sum(counts) == len(set(ids)) and max(counts) - min(counts) <= 1
            for exchange in ("full", "topk"):
                assert {case[exchange][0] for case in cases} == {exchange}
                logits = [case[exchange][1] for case in cases]
                assert all(torch.equal(logits[0], other) for other in logits[1:]), (name, layout, exchange)
            full, packed = cases[0]["full"][1], cases[0]["topk"][1]
            torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-4)
            want_p, want_i = torch.softmax(full, -1).topk(topk, dim=-1)
            got_p, got_i = torch.softmax(packed, -1).topk(topk, dim=-1)
            assert torch.equal(full.gather(1, got_i), full.gather(1, want_i)), (name, layout)
            torch.testing.assert_close(got_p, want_p, rtol=1e-4, atol=1e-6)
            refreshed = [case["refreshed"] for case in cases]
            assert all(torch.equal(refreshed[0], other) for other in refreshed[1:]), (name, layout)
            torch.testing.assert_close(refreshed[0], updated, rtol=1e-5, atol=1e-4)
