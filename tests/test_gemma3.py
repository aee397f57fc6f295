"""Gemma 3 270M, a real pretrained model (262144-id vocab, tied LM head), served on CPU.

The fixture (``sglang_frspec/demo/gemma3.py``) converts the packaged GGUF once and records HF
float32 greedy continuations of the demo's and held-out prompts; ``gemma3_checks`` records, off the
demo's path, its perplexity on held-out prose and a prompt past the sliding window. Here
SGLang's plain greedy decoding at TP=1 must equal that reference, and the README's main job
(``sglang-frspec demo``, whose default is this model at TP=2: plain greedy, stock EAGLE without a
map, EAGLE + a 32768-id map through the plugin) must decode every run as plain greedy and plain
greedy as Transformers. Gemma 3's tied head reaches the draft as each rank's row slice of an
embedding table every rank holds whole (``Gemma3ForCausalLM.get_embed_and_head``).

The TP=1 batch also holds a prompt of 700 tokens, past Gemma 3's 512-token sliding window: the
CPU attention stand-in (``sglang_frspec/demo/cpu_site/sgl_kernel``) must apply the window as
Gemma 3 does. That TP=1 server runs with torch.compile on (the CPU environment turns it off
elsewhere, to save its warm-up): the CPU site's torch patches must leave SGLang's compiled
functions (here Gemma 3's rotary embedding) traceable.

One server or server set runs at a time (a TP=2 server of this model holds about 7.5 GB: 2.7 GB
per rank, 2.2 GB in its launcher and detokenizer).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from sglang_frspec.cli import build_parser
from sglang_frspec.cli import demo as demo_command
from sglang_frspec.demo.gemma3 import (
    MAX_PERPLEXITY,
    NEW_TOKENS,
    SERVER_ARGS,
    gemma3_checks,
    gemma3_fixture,
)
from sglang_frspec.demo.server import plugin_activity
from tests.conftest import fixture_server
from tests.harness.gpu_defaults.overlap import relayed_ranks
from tests.test_contract import INSTALLED, pinned_sglang
from tests.test_servers_plugin import num_hot
from tools.serving.greedy import TIE_EPSILON, compare_greedy
from tools.serving.zygote import forked_launch

pytestmark = pytest.mark.server
# SGLang's float32 forward and HF's differ by rounding only (their greedy outputs were equal in
# every run here); a top-2 flip passes below this margin, as against tests/test_architectures.py's
# HF reference, and the diverging ids must be HF's top two.
HF_TIE_EPSILON = 1e-2
# Accept length the shipped draft must reach in the demo (docs/results/gemma3-draft.txt).
SHIPPED_DRAFT_ACCEPT_FLOOR = 1.3
PLAIN, STOCK, PLUGIN = "plain greedy (reference)", "EAGLE, no map (stock)", "EAGLE + map (sglang-frspec)"


@pytest.fixture(scope="module")
def gemma3():
    return gemma3_fixture()


@pytest.fixture(scope="module")
def checks():
    return gemma3_checks()


@pytest.fixture(scope="module")
def plain_tp1(gemma3, checks, tmp_path_factory):
    """Every prompt, then the prompt past the sliding window, decoded greedily in one batch by a
    plain TP=1 server with torch.compile on (the CPU environment turns it off: Gemma 3's rotary
    embedding is compiled, and the CPU site's ``torch.get_device_module`` must trace). One server
    compiles here rather than the demo's three: each compiling server costs about 20 s more."""
    log = tmp_path_factory.mktemp("gemma3-plain") / "tp1.log"
    prompts = [*gemma3.prompts, checks["past_window"]["prompt"]]
    compile_on = {"TORCHDYNAMO_DISABLE": "0"}
    with fixture_server(gemma3, 1, log, extra=SERVER_ARGS, eagle=False, env=compile_on) as server:
        return [o["output_ids"] for o in server.generate(prompts, NEW_TOKENS, ignore_eos=True)]


@pytest.fixture(scope="module")
def demo(gemma3, tmp_path_factory):
    """``sglang-frspec demo`` on its default (this model, TP=2), one request per prompt. Run in this
    process with its servers forked from the zygote (about 35 s less per server than the new
    Pythons a user's run starts; tests/test_cli.py starts one server so, with spawned schedulers)."""
    folder = tmp_path_factory.mktemp("gemma3-demo")
    argv = ["demo", "--requests", str(len(gemma3.prompts)), "--one-at-a-time", "1", "--log-dir", str(folder)]
    args = build_parser().parse_args([*argv, "--json", str(folder / "demo.json")])
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = demo_command.run(args, launch=forked_launch)
    assert status == 0, stdout.getvalue()[-4000:]
    return {"stdout": stdout.getvalue(), **json.loads((folder / "demo.json").read_text())}


def test_fixture_is_the_converted_model_with_a_prompt_past_the_sliding_window(gemma3, checks):
    # A broken conversion (norms left as 1 + w, a permuted Q/K, no BOS) gives hundreds or more.
    assert checks["perplexity"] < MAX_PERPLEXITY
    past_prompt, past_reference = checks["past_window"]["prompt"], checks["past_window"]["greedy"]
    assert all(p[0] == 2 for p in [*gemma3.prompts, past_prompt])  # BOS (id 2) leads every prompt
    assert all(len(r) == NEW_TOKENS for r in [*gemma3.reference, past_reference])
    config = json.loads((Path(gemma3.target) / "config.json").read_text())
    assert "sliding_attention" in config["layer_types"]
    assert len(past_prompt) > config["sliding_window"] == 512


def test_plain_greedy_at_tp1_equals_transformers(gemma3, plain_tp1):
    compare_greedy(gemma3.target, gemma3.prompts, plain_tp1[:-1], gemma3.reference, HF_TIE_EPSILON)


def test_plain_greedy_past_the_sliding_window_equals_transformers(gemma3, checks, plain_tp1):
    """700 prompt tokens and 48 generated: every step of the sliding-window layers sees the window."""
    past_prompt, past_reference = checks["past_window"]["prompt"], checks["past_window"]["greedy"]
    compare_greedy(gemma3.target, [past_prompt], plain_tp1[-1:], [past_reference], HF_TIE_EPSILON)


def test_plain_greedy_at_tp2_equals_transformers(gemma3, demo):
    assert [p["input_ids"] for p in demo["prompts"]] == gemma3.prompts
    plain = demo["runs"][PLAIN]["outputs"]
    compare_greedy(gemma3.target, gemma3.prompts, plain, gemma3.reference, HF_TIE_EPSILON)


@pytest.mark.parametrize("run", [STOCK, PLUGIN])
def test_eagle_at_tp2_decodes_as_plain_greedy(gemma3, demo, run):
    """Stock EAGLE without a map, and EAGLE with the 32768-id map through the plugin (whose start-up
    line the server log must show; stock must show none)."""
    result = demo["runs"][run]
    expected_activity = [(num_hot(gemma3.token_map(32768)), 2, "balanced", "full")] if run == PLUGIN else []
    assert [tuple(a) for a in result["plugin"]] == expected_activity
    plain = demo["runs"][PLAIN]["outputs"]
    compare_greedy(gemma3.target, gemma3.prompts, result["outputs"], plain, TIE_EPSILON)
    alone = result["one_at_a_time"]["outputs"]  # the first prompt, one request at a time
    compare_greedy(gemma3.target, gemma3.prompts[:1], alone, demo["runs"][PLAIN]["one_at_a_time"]["outputs"],
                   TIE_EPSILON)  # fmt: skip
    # The shipped draft's floor on the fixture's prompts at the demo's spec (1 step, topk 1, 2 draft
    # tokens: at most 2; an untrained draft gives about 1.0): measured 1.37 stock and with the map
    # on the prompts before issue 53's split. It tells a trained draft from an untrained one, not
    # two trained drafts: round 1's served 1.53/1.35 (code/prose) at this spec, round 2's 1.52/1.33,
    # where 7 prompts x 48 tokens resolve about +-0.06; round 3 (shipped) gives 1.45-1.46 on these
    # prompts where round 2 gave 1.38-1.39, a gap no floor between them would hold on other floats.
    assert result["accept_length"] >= SHIPPED_DRAFT_ACCEPT_FLOOR


def test_demo_shows_the_text_each_run_generates(demo):
    """The README's main job: real prompts, the generated text, and the summary table."""
    assert "prompt 1: 'The capital of France is'" in demo["stdout"]
    assert "plain greedy equals Transformers' float32 greedy decoding: yes" in demo["stdout"]
    assert "all outputs equal plain greedy decoding" in demo["stdout"]


def test_demo_prints_the_fr_spec_effect_first_then_the_hosts_break_even(demo):
    """The run's own figures, one request at a time: the plugin against stock EAGLE first, then the
    host's break-even accept length (a cycle's seconds over a plain step's, from the demo's JSON)
    against the draft's, then the ratio to plain decoding, which the two decide."""
    plain, stock, plugin = (demo["runs"][name]["one_at_a_time"] for name in (PLAIN, STOCK, PLUGIN))
    step = plain["seconds"] / sum(len(o) for o in plain["outputs"])
    even = plugin["seconds"] / plugin["cycles"] / step
    accept = sum(len(o) for o in plugin["outputs"]) / plugin["cycles"]
    lines = demo["stdout"].splitlines()
    effect = next(i for i, line in enumerate(lines) if "FR-Spec effect" in line)
    host = next(i for i, line in enumerate(lines) if "this host's break-even accept length" in line)
    against = next(i for i, line in enumerate(lines) if "against plain decoding" in line)
    assert effect < host < against
    assert f"runs {plugin['tokens_per_s'] / stock['tokens_per_s']:.2f}x stock EAGLE" in lines[effect]
    assert f"break-even accept length: {even:.2f} " in lines[host]
    assert lines[host].endswith(f"the draft's: {accept:.2f}")
    ratio = plugin["tokens_per_s"] / plain["tokens_per_s"]
    assert ratio == pytest.approx(accept / even)  # the cost model: a * t_plain / t_cycle
    assert ("beats it here" if accept > even else "does not beat it here") in lines[against]
    assert f"{ratio:.2f}x" in lines[against]


@pytest.mark.every_release
@pytest.mark.skipif(
    pinned_sglang() == INSTALLED, reason="the demo's tests above check it on the pinned release, stock beside"
)
def test_eagle_with_the_map_at_tp2_decodes_as_plain_greedy_on_an_older_release(gemma3, tmp_path):
    """An older SGLang release (scripts/test-releases): Gemma 3's tied head through the plugin at
    TP=2, overlap on, decodes every prompt as that release's plain greedy, which decodes as
    Transformers."""
    prompts, token_map = gemma3.prompts, gemma3.token_map(32768)
    with fixture_server(gemma3, 2, tmp_path / "plain.log", extra=SERVER_ARGS, eagle=False) as server:
        plain = [o["output_ids"] for o in server.generate(prompts, NEW_TOKENS, ignore_eos=True)]
    compare_greedy(gemma3.target, prompts, plain, gemma3.reference, HF_TIE_EPSILON)
    with fixture_server(gemma3, 2, tmp_path / "plugin.log", token_map, extra=SERVER_ARGS) as server:
        outputs = [o["output_ids"] for o in server.generate(prompts, NEW_TOKENS, ignore_eos=True)]
        log = server.log()
    assert plugin_activity(log) == [(num_hot(token_map), 2, "balanced", "full")]
    assert relayed_ranks(log) == {0, 1}
    compare_greedy(gemma3.target, prompts, outputs, plain, TIE_EPSILON)
