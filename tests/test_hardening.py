"""GPU paths CPU tests never ran before (issue: hardening): drafts that keep their own head,
start-up memory of the hot head, weight updates, the fp32 head and softcapping against SGLang's
own LogitsProcessor, and argument-time behaviour that now matches stock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from sglang_frspec.core import vocab_shard_ranges
from sglang_frspec.testing.cpu import cpu_env
from sglang_frspec.testing.tp_group import run_tp_group

CASES = "tests.rank_cases_hardening"


def _skewed_map(vocab: int, num_hot: int, seed: int = 0) -> list[int]:
    """BPE-like skew: frequent tokens concentrate at low ids (most hot ids on rank 0)."""
    weights = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 50.0)
    return torch.multinomial(
        weights, num_hot, replacement=False, generator=torch.Generator().manual_seed(seed)
    ).tolist()


# ---------------------------------------------------------------- 2. start-up memory
@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_building_the_hot_head_stays_within_its_memory_budget(tp):
    """Peak extra memory of building (and refreshing) the head <= the head + one chunk, under a
    skewed map at TP 2/4/8 (the old one-shot exchange held tp x max-owned rows at once), and the
    head holds exactly the reference rows."""
    vocab, hidden, num_hot, chunk = 128256, 256, 32768, 2 << 20
    hot = _skewed_map(vocab, num_hot)
    payload = {"vocab": vocab, "hidden": hidden, "map": hot, "chunk_bytes": chunk}
    results = run_tp_group(f"{CASES}:head_build_memory", tp, payload, timeout=600)
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


# ---------------------------------------------------------------- 3. weight updates
@pytest.mark.multirank
def test_weight_updates_refresh_once_per_completed_update_on_every_rank():
    vocab, hidden = 5003, 32
    payload = {"vocab": vocab, "hidden": hidden, "map": _skewed_map(vocab, 700)}
    results = run_tp_group(f"{CASES}:weight_update_refresh", 2, payload, timeout=300)
    # (refreshes, head == hot rows of the weights it should hold at that point)
    expected = {
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
    }
    for rank, result in enumerate(results):
        got = {case: (r["refreshes"], r["fresh"]) for case, r in result.items()}
        assert got == expected, rank
    assert [r["disk_flush_refused_on_rank0"]["success"] for r in results] == [False, True]


# ---------------------------------------------------------------- 4. fp32 head, softcap, scale
@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_draft_logits_equal_sglangs_logits_processor(dtype):
    """Every config branch of the head computation, against SGLang's LogitsProcessor over the
    full target head (its hot columns), on the same inputs: full exchange bit-identical, top-k
    exchange with the identical top-k values and ids."""
    vocab, hidden, topk = 5003, 48, 4
    variants = {
        "plain": {},
        "fp32_head": {"config": {"enable_lm_head_fp32": True}},
        "fp32_output": {"config": {"enable_lm_head_output_fp32": True}},
        "logit_scale": {"logit_scale": 0.37},
        "softcap": {"config": {"final_logit_softcapping": 20.0}},
        "softcap_fp32_head": {"config": {"final_logit_softcapping": 20.0, "enable_lm_head_fp32": True}},
    }
    payload = {"vocab": vocab, "hidden": hidden, "dtype": dtype, "rows": 5, "scale": 1.5, "topk": topk,
               "map": _skewed_map(vocab, 600), "variants": variants}  # fmt: skip
    results = run_tp_group(f"{CASES}:logits_vs_stock", 2, payload, timeout=300)
    for name in variants:
        stock = results[0][name]["stock"]
        assert stock.dtype == torch.float32
        if "softcap" in name:  # the cap really bites, without saturating into ties
            assert stock.abs().max() < 20.0 and (stock - results[0]["plain"]["stock"]).abs().max() > 0.5
        for layout in ("local", "balanced"):
            assert torch.equal(results[0][name][layout, "full"], stock), (name, layout)
            assert torch.equal(results[1][name][layout, "full"], stock), (name, layout)
            got = results[0][name][layout, "topk"]
            want_values, want_ids = stock.topk(topk, dim=1)
            got_values, got_ids = got.topk(topk, dim=1)
            assert torch.equal(got_values, want_values) and torch.equal(got_ids, want_ids), (name, layout)
            torch.testing.assert_close(
                torch.softmax(got, 1).gather(1, got_ids), torch.softmax(stock, 1).gather(1, want_ids),
                rtol=1e-5, atol=1e-7,
            )  # fmt: skip


# ---------------------------------------------------------------- 1. drafts that keep their head
@pytest.mark.multirank
def test_processor_refuses_a_head_that_is_not_the_hot_head():
    payload = {"vocab": 5003, "hidden": 32, "map": _skewed_map(5003, 700)}
    for message in run_tp_group(f"{CASES}:head_guard", 2, payload, timeout=300):
        assert "passed an LM head of shape (2528, 32)" in message
        assert "not this rank's hot head (350 rows)" in message


KEEPS_OWN_HEAD_DRAFT = '''
from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle


class KeepsOwnHeadLlamaEagle(LlamaForCausalLMEagle):
    """Like step3p5_mtp: set_embed_and_head keeps the draft's own (full-vocab) head."""

    def set_embed_and_head(self, embed, head):
        return


EntryClass = KeepsOwnHeadLlamaEagle
'''


@pytest.mark.server
def test_draft_that_keeps_its_own_head_fails_on_every_rank(perm, start_server, tmp_path):
    """A draft whose set_embed_and_head ignores the hot head (stock would crash or, at TP=1,
    silently read columns 0..H-1): every rank fails at start-up naming the draft class."""
    package = tmp_path / "site" / "frspec_test_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "keeps_own_head.py").write_text(KEEPS_OWN_HEAD_DRAFT)
    draft = tmp_path / "keeps-own-head-eagle"
    shutil.copytree(perm.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"architectures": ["KeepsOwnHeadLlamaEagle"]}))
    env = {  # SGLang's own way to add model classes from a package
        "SGLANG_EXTERNAL_MODEL_PACKAGE": "frspec_test_models",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")])),
    }
    server = start_server(perm, 2, perm.token_map("hot"), wait=False, env=env,
                          extra=("--speculative-draft-model-path", str(draft)))  # fmt: skip
    assert server.wait_exit(180) != 0  # found after the weights load, as the tied draft
    log = server.log_path.read_text()
    assert (
        "the draft model KeepsOwnHeadLlamaEagle keeps its own LM head (lm_head) after set_embed_and_head()"
        in log
    )
    # Raised after the ranks' agreement, which every rank joins with its own check.
    assert "[sglang-frspec, TP rank 0 of 2] the draft model KeepsOwnHeadLlamaEagle" in log


# ---------------------------------------------------------------- 5/6. argument time
RESOLVE = """
import json, logging, sys
messages = []
class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.basicConfig(level=logging.WARNING, handlers=[Collect()])
from sglang.srt.plugins import load_plugins
load_plugins()  # as the launcher does: this plugin (SGLANG_PLUGINS) registers and applies its hooks
from sglang.srt.server_args import ServerArgs
for fields in json.loads(sys.argv[1]):
    messages.clear()
    args = ServerArgs(**fields)
    try:
        args.resolve_once()
        result = f"RESOLVED {args.speculative_algorithm}"
    except Exception as e:
        result = f"ERROR {type(e).__name__} {e}"
    print("CASE", json.dumps([result, messages]))
"""
EAGLE = {"speculative_algorithm": "EAGLE"}
REJECTION_SAMPLING = EAGLE | {"speculative_use_rejection_sampling": True, "speculative_eagle_topk": 1,
                              "speculative_num_steps": 2, "speculative_num_draft_tokens": 3}  # fmt: skip


@pytest.fixture(scope="module")
def resolved(perm, tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
    """SGLang's real argument resolution (with this plugin registered) of every case below, in
    one child process: {case: (RESOLVED <algorithm> or ERROR <type> <message>, logged messages)}."""
    tmp_path = tmp_path_factory.mktemp("resolve")
    maps = {"hot": perm.token_map("hot")}
    torch.save(torch.arange(perm.vocab_size), tmp_path / "whole.pt")
    maps["whole"] = str(tmp_path / "whole.pt")
    cases = {
        "no algorithm": ("hot", {}),
        "frozen kv mtp": ("hot", {"speculative_algorithm": "FROZEN_KV_MTP"}),
        "rejection sampling": ("hot", REJECTION_SAMPLING),
        "rejection sampling, whole vocab": ("whole", REJECTION_SAMPLING),
    }
    fields = [
        {"model_path": perm.target, "device": "cpu", "tp_size": 2, "speculative_token_map": maps[name]}
        | ({"speculative_draft_model_path": perm.draft} if extra else {})
        | extra
        for name, extra in cases.values()
    ]
    out = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(fields)], env=cpu_env(2),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(cases), out.stdout[-3000:]
    return {case: (result, messages) for case, (result, messages) in zip(cases, results)}


def test_map_without_an_algorithm_is_ignored_as_in_stock(resolved):
    result, messages = resolved["no algorithm"]
    assert result == "RESOLVED None"
    assert any(
        m.startswith("--speculative-token-map is ignored without --speculative-algorithm.") for m in messages
    )


def test_map_with_frozen_kv_mtp_is_ignored_as_in_stock(resolved):
    result, messages = resolved["frozen kv mtp"]
    assert result == "RESOLVED FROZEN_KV_MTP"
    assert any(m.startswith("--speculative-token-map is ignored for FROZEN_KV_MTP") for m in messages)


def test_rejection_sampling_with_a_map_fails_at_argument_time(resolved):
    """Even a map holding the whole vocab (which passes upstream's after-load guard)."""
    for case in ("rejection sampling", "rejection sampling, whole vocab"):
        result, _ = resolved[case]
        assert result.startswith("ERROR UnsupportedSetupError --speculative-token-map cannot be combined "
                                 "with --speculative-use-rejection-sampling"), (case, result)  # fmt: skip
