"""Bad inputs and unsupported setups fail clearly, before serving: bad maps and unsupported
combinations in the launcher's argument resolution (before any model loads; one of each kind in a
real launcher), heads and drafts the plugin cannot serve at start-up on every rank, and the
argument-time cases that behave as stock does. Every case runs a real server start-up, SGLang's
own argument resolution or a real SGLang object."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_frspec.demo.cpu import cpu_env
from sglang_frspec.demo.server import ServerError
from tests import rank_cases_adapt, rank_cases_adapters
from tests.conftest import fixture_server, fixture_server_args
from tests.harness.forked_python import run_python
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_adapters import skewed_ids

# Argument-time failures exit from the launcher before any scheduler starts or model loads:
# the time is Python start-up plus importing SGLang. Measured 29-32 s for a new Python on the
# 2-core machine at a load average of 13-17 (several engineers' tests at once); a launcher forked
# from a zygote skips a part of the imports. The bound is about 2x that worst case (a hang or a
# model load would exceed it).
ARGUMENT_TIME_EXIT = 60
# A failure found once the draft is loaded (schedulers spawned, both models loaded, then every
# rank raises and the launcher exits): measured 82 s at the same load; about 2x again.
AFTER_LOAD_EXIT = 180
LOAD_WEIGHTS = "Load weight begin"  # SGLang's log line when a model starts loading (shown present below)

BAD_MAPS = {
    "missing": (None, "no such file"),
    "garbage": (b"not a torch file", "cannot be read with torch.load(weights_only=True)"),
    "2d": (torch.zeros(2, 3, dtype=torch.int64), "2-D tensor of shape (2, 3)"),
    "float": (torch.tensor([1.0, 2.0]), "holds a torch.float32 tensor"),
    "bool": (torch.tensor([True, False]), "holds a torch.bool tensor"),
    "strings": (["w5", "w6"], "str element ('w5')"),
    "empty": (torch.zeros(0, dtype=torch.int64), "is empty"),
    "negative": (torch.tensor([5, -1, 7]), "1 negative id(s)"),
    "too_big": (torch.tensor([5, 40000]), "1 id(s) >= the target's vocab size 32000"),
    "padding_row": (torch.tensor([5, 32000]), "would select padding or LoRA-added rows"),
    # Stock passes it and dies at the first request in fast_topk (the servers here use topk 2).
    "below_topk": (torch.tensor([7, 7]), "holds 1 distinct id(s), fewer than --speculative-eagle-topk 2"),
}


def _write_map(tmp_path, case):
    content, _ = BAD_MAPS[case]
    path = tmp_path / f"{case}.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    return str(path)


UNSUPPORTED = [
    (["--speculative-algorithm", "STANDALONE"], "works only with --speculative-algorithm EAGLE"),
    (["--speculative-algorithm", "NGRAM"], "works only with --speculative-algorithm EAGLE"),
    (["--enable-multi-layer-eagle"], "cannot be combined with --enable-multi-layer-eagle"),
    (["--load-format", "gguf"], "cannot be used with a GGUF target"),
]
ADAPT = {"SGLANG_FRSPEC_ADAPT": "1"}
ADAPT_REFUSED = {  # name: (extra args, env, message)
    "pd": (["--disaggregation-mode", "decode"], ADAPT | {"SGLANG_FRSPEC_LAYOUT": "local"},
           "cannot serve a prefill/decode deployment"),
    "no coverage": ([], ADAPT | {"SGLANG_FRSPEC_COVERAGE": "0"},
                    "follows the counts of the committed tokens"),
}  # fmt: skip


@pytest.fixture(scope="module")
def argument_time_cases(perm, tmp_path_factory) -> dict[str, tuple[str, list[str], dict, str]]:
    """{case: (token map, extra launcher arguments, env, message)} of every argument-time refusal."""
    tmp_path = tmp_path_factory.mktemp("bad-maps")
    cases = {
        f"map {case}": (_write_map(tmp_path, case), [], {}, message)
        for case, (_, message) in BAD_MAPS.items()
    }
    cases |= {
        f"args {' '.join(extra)}": (perm.token_map("hot"), extra, {}, message)
        for extra, message in UNSUPPORTED
    }
    cases |= {
        f"adapt {name}": (perm.token_map("hot"), extra, env, message)
        for name, (extra, env, message) in ADAPT_REFUSED.items()
    }
    return cases


# Every argument-time case is checked in SGLang's own resolution of the launcher's arguments (the
# `resolved` child below: what sglang.launch_server runs before it starts anything); one case of
# each kind also runs as a real TP=2 launcher, which must exit with the message before any model
# loads (each launcher is about 6 s of a core: all 17 took a minute of the suite).
LAUNCHED = ("map garbage", "args --speculative-algorithm STANDALONE", "adapt pd")


@pytest.fixture(scope="module")
def argument_time_exits(
    perm, argument_time_cases, tmp_path_factory
) -> dict[str, tuple[int | None, str, str]]:
    """Each ``LAUNCHED`` case as its own real TP=2 launcher (forked from a zygote that made the
    launcher's first imports), run to its exit a core's worth at a time: {case: (exit status or
    None if still running after ARGUMENT_TIME_EXIT, log, the message it must give)}."""
    tmp_path = tmp_path_factory.mktemp("argument-time")

    def launch(i: int, case: str) -> tuple[int | None, str, str]:
        token_map, extra, env, message = argument_time_cases[case]
        log = tmp_path / f"launch{i}.log"
        server = fixture_server(perm, 2, log, token_map, extra=tuple(extra), env=env).start()
        try:
            status = server.wait_exit(ARGUMENT_TIME_EXIT)
        except ServerError:
            status = None
        finally:
            server.stop()
        return status, server.log(), message

    with ThreadPoolExecutor(min(4, len(os.sched_getaffinity(0)))) as pool:
        return dict(zip(LAUNCHED, pool.map(launch, range(len(LAUNCHED)), LAUNCHED)))


@pytest.mark.every_release
@pytest.mark.server
@pytest.mark.parametrize("case", LAUNCHED)
def test_the_launcher_exits_with_the_message_before_any_model_loads(argument_time_exits, case):
    status, log, message = argument_time_exits[case]
    assert status is not None and status != 0, (status, log[-3000:])
    assert message in log, log[-3000:]
    assert LOAD_WEIGHTS not in log  # rejected at argument time: no model was loaded


def _refused_at_argument_time(resolved: dict, case: str, message: str) -> str:
    result, _ = resolved[case]
    assert result.startswith("ERROR ") and message in result, result
    return result


@pytest.mark.parametrize("case", sorted(BAD_MAPS))
def test_bad_map_fails_fast_before_device_work(resolved, case):
    assert f"{case}.pt" in _refused_at_argument_time(resolved, f"map {case}", BAD_MAPS[case][1])


@pytest.mark.parametrize(("extra", "message"), UNSUPPORTED)
def test_unsupported_combinations_are_rejected_at_argument_time(resolved, extra, message):
    _refused_at_argument_time(resolved, f"args {' '.join(extra)}", message)


@pytest.mark.parametrize("name", sorted(ADAPT_REFUSED))
def test_adaptation_it_cannot_serve_is_refused_at_argument_time(resolved, name):
    _refused_at_argument_time(resolved, f"adapt {name}", ADAPT_REFUSED[name][2])


@pytest.mark.server
def test_tied_draft_fails_on_every_rank(perm, start_server, tmp_path):
    """Found only once the draft is loaded: every rank raises together; the server exits."""
    draft = tmp_path / "tied-eagle"
    shutil.copytree(perm.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    server = start_server(perm, 2, perm.token_map("hot"), wait=False,
                          extra=("--speculative-draft-model-path", str(draft)))  # fmt: skip
    assert server.wait_exit(AFTER_LOAD_EXIT) != 0
    log = server.log()
    assert "ties its LM head to its input embeddings (tie_word_embeddings" in log
    # The prefix is raised only after every rank joined the agreement with its own check, and
    # then by every rank alike. Which schedulers' tracebacks reach the log is a race (SGLang
    # kills the tree at the first scheduler's SIGQUIT), so the log cannot show each rank's.
    assert "[sglang-frspec, TP rank 0 of 2] the draft model ties its LM head" in log
    # Positive control for the argument-time tests: a start-up that loaded models logs this.
    assert LOAD_WEIGHTS in log


def test_hook_guard_rejects_tp_maps_when_hooks_are_not_active(perm, tmp_path):
    """register() ran but SGLang did not apply the hooks: refuse, naming the hook."""
    script = f"""
from sglang.srt.server_args import ServerArgs
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_frspec import plugin
from sglang_frspec.adapters.args import check_speculative_args
plugin.register()
args = ServerArgs(model_path={perm.target!r}, tp_size=2, device="cpu",
                  speculative_algorithm="EAGLE", speculative_draft_model_path={perm.draft!r},
                  speculative_token_map={perm.token_map("hot")!r})
try:
    check_speculative_args(args, lambda a: None)
except Exception as e:
    print("REFUSED:", e)
HookRegistry.apply_hooks()
check_speculative_args(args, lambda a: None)
print("ACCEPTED after apply_hooks")
"""
    status, output = run_python(script, [], cpu_env(2), tmp_path / "child.log", timeout=300)
    assert status == 0, output[-3000:]
    assert "REFUSED: sglang-frspec is loaded but its hook(s) on" in output
    assert "EagleDraftWorker.init_lm_head" in output
    assert output.rstrip().endswith("ACCEPTED after apply_hooks")


def test_quantized_or_packed_heads_are_rejected(tmp_path):
    """A real SGLang ParallelLMHead built with a quantization config that packs the head."""
    script = """
from sglang.srt.layers.quantization.gguf import GGUFConfig
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.runtime_context import get_parallel
from sglang_frspec.adapters.head import check_head_supported
with get_parallel().override(tp_rank=0, tp_size=1):
    check_head_supported(ParallelLMHead(1000, 64))
    try:
        check_head_supported(ParallelLMHead(1000, 64, quant_config=GGUFConfig()))
    except Exception as e:
        print(type(e).__name__, e)
"""
    status, output = run_python(script, [], cpu_env(1), tmp_path / "child.log", timeout=300)
    assert status == 0, output[-3000:]
    assert output.startswith("UnsupportedSetupError the target LM head is quantized (GGUFEmbeddingMethod)")


@pytest.mark.multirank
def test_processor_refuses_a_head_that_is_not_the_hot_head():
    payload = {"vocab": 5003, "hidden": 32, "map": skewed_ids(5003, 700)}
    for message in run_tp_group(rank_cases_adapters.head_guard, 2, payload, timeout=300):
        assert "passed an LM head of shape (2528, 32)" in message
        assert "not this rank's hot head (350 rows)" in message


@pytest.mark.server
def test_draft_that_keeps_its_own_head_fails_on_every_rank(perm, start_server, tmp_path):
    """A draft whose set_embed_and_head ignores the hot head (stock would crash or, at TP=1,
    silently read columns 0..H-1): every rank fails at start-up naming the draft class."""
    draft = tmp_path / "keeps-own-head-eagle"
    shutil.copytree(perm.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"architectures": ["KeepsOwnHeadLlamaEagle"]}))
    # SGLang's own way to add model classes from a package (tests/harness/external_models/).
    env = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "tests.harness.external_models"}
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


# SGLang's own argument resolution, as sglang.launch_server runs it (launch_server.py: plugins, then
# prepare_server_args of the command line, then resolve_once), of launcher command lines
# ("argv") or ServerArgs fields ("fields").
RESOLVE = """
import json, logging, sys
messages = []
class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.basicConfig(level=logging.WARNING, handlers=[Collect()], force=True)
from sglang.srt.plugins import load_plugins
load_plugins()  # as the launcher does: this plugin (SGLANG_PLUGINS) registers and applies its hooks
import os
from sglang.srt.server_args import ServerArgs, prepare_server_args
for how, given, env in json.loads(sys.argv[1]):
    messages.clear()
    os.environ.update(env)  # the plugin's options, read at resolution
    try:
        args = prepare_server_args(given) if how == "argv" else ServerArgs(**given)
        args.resolve_once()
        result = f"RESOLVED {args.speculative_algorithm}"
    except Exception as e:
        result = f"ERROR {type(e).__name__} {e}"
    for name in env:
        del os.environ[name]
    print("CASE", json.dumps([result, messages]))
"""
EAGLE = {"speculative_algorithm": "EAGLE"}
# SGLANG_FRSPEC_ADAPT=1 with the default (balanced) layout, in SGLang's resolution: served at TP 2
# and 3; DP attention (either spelling) refused, as every idle DP rank would leave the decision.
ADAPT_RESOLVED = {
    "tp 2": {},
    "tp 3": {"tp_size": 3},
    "dp attention": {"enable_dp_attention": True, "dp_size": 2},
    "attn dp size": {"attn_dp_size": 2},
}
DP_ATTENTION_REFUSED = "SGLANG_FRSPEC_ADAPT=1 cannot be combined with DP attention (--attn-dp-size > 1"
REJECTION_SAMPLING_FIELDS = EAGLE | {"speculative_use_rejection_sampling": True, "speculative_eagle_topk": 1,
                              "speculative_num_steps": 2, "speculative_num_draft_tokens": 3}  # fmt: skip


@pytest.fixture(scope="module")
def resolved(perm, argument_time_cases, tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
    """SGLang's real argument resolution (with this plugin registered) of every case below and
    every argument-time refusal's launcher arguments, in one child process: {case: (RESOLVED
    <algorithm> or ERROR <type> <message>, logged messages)}."""
    tmp_path = tmp_path_factory.mktemp("resolve")
    maps = {"hot": perm.token_map("hot")}
    torch.save(torch.arange(perm.vocab_size), tmp_path / "whole.pt")
    maps["whole"] = str(tmp_path / "whole.pt")
    cases = {  # name: (map, fields, env)
        "no algorithm": ("hot", {}, {}),
        "frozen kv mtp": ("hot", {"speculative_algorithm": "FROZEN_KV_MTP"}, {}),
        "rejection sampling": ("hot", REJECTION_SAMPLING_FIELDS, {}),
        "rejection sampling, whole vocab": ("whole", REJECTION_SAMPLING_FIELDS, {}),
        **{f"adapt {name}": ("hot", EAGLE | extra, ADAPT) for name, extra in ADAPT_RESOLVED.items()},
    }
    given = [
        [
            "fields",
            {"model_path": perm.target, "device": "cpu", "tp_size": 2, "speculative_token_map": maps[name]}
            | ({"speculative_draft_model_path": perm.draft} if extra else {})
            | extra,
            env,
        ]
        for name, extra, env in cases.values()
    ]
    cases |= argument_time_cases
    given += [
        ["argv", fixture_server_args(perm, 2, token_map, extra=tuple(extra)), env]
        for token_map, extra, env, _ in argument_time_cases.values()
    ]
    status, output = run_python(
        RESOLVE, [json.dumps(given)], cpu_env(2), tmp_path / "resolve.log", timeout=300
    )
    assert status == 0, output[-3000:]
    results = [json.loads(line[5:]) for line in output.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(cases), output[-3000:]
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


def test_rejection_sampling_with_a_map_resolves(resolved):
    """No longer refused (the plugin lays the hot probabilities over the target vocab for verify;
    tests/test_servers_plugin.py serves it), with a hot map or one holding the whole vocab."""
    for case in ("rejection sampling", "rejection sampling, whole vocab"):
        assert resolved[case][0] == "RESOLVED EAGLE", (case, resolved[case])


def test_adaptation_with_the_default_layout_resolves_at_tp_2_and_3(resolved):
    for case in ("adapt tp 2", "adapt tp 3"):
        assert resolved[case][0] == "RESOLVED EAGLE", (case, resolved[case])


def test_adaptation_with_dp_attention_is_refused_at_resolution(resolved):
    """Both spellings: --attn-dp-size 2, and the deprecated --enable-dp-attention --dp-size 2
    (resolution folds it into attn_dp_size and leaves enable_dp_attention false)."""
    for case in ("adapt dp attention", "adapt attn dp size"):
        result, _ = resolved[case]
        assert result.startswith(f"ERROR UnsupportedSetupError {DP_ATTENTION_REFUSED}"), (case, result)


@pytest.mark.multirank
def test_adaptation_under_dp_attention_is_refused_where_the_adapter_is_built():
    """Past the launcher (an Engine, the drop-in worker), every rank refuses when it builds the
    adapter, with the same agreed error, instead of hanging at the first decision an idle DP rank
    skips: a real TP=2 group with 2 attention-DP ranks."""
    payload = {"vocab": 1000, "hidden": 32, "hot": list(range(0, 1000, 7))}
    errors = run_tp_group(rank_cases_adapt.adapter_refusal, 2, payload,
                          server_args={"enable_dp_attention": True, "dp_size": 2})  # fmt: skip
    assert len(errors) == 2  # without DP attention it builds (tests/test_adapt.py, the FP8 head)
    for error in errors:
        assert error.startswith(f"[sglang-frspec, TP rank 0 of 2] {DP_ATTENTION_REFUSED}"), error
