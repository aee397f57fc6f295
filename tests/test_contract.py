"""The contract with SGLang (adapters/contract.py): it holds on the installed SGLang, live and
from source; a changed SGLang is named in one logged line, gets none of the hooks, and a token
map at TP > 1 is refused at argument time while TP = 1 resolves as stock."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from scripts.check_sglang_releases import release_test_runs
from sglang_frspec.adapters import contract
from sglang_frspec.adapters.contract_check import (
    Contains,
    LiveSGLang,
    Named,
    Signature,
    SourceSGLang,
)
from sglang_frspec.adapters.hooks import VARIANTS, hook_target
from sglang_frspec.demo.cpu import cpu_env
from tests.harness.forked_python import run_python
from tools.gpu_kit.build import KIT_PINS

REPO = Path(__file__).resolve().parent.parent
SITE = Path(importlib.util.find_spec("sglang").origin).parent.parent  # the folder holding sglang/
INSTALLED = importlib.metadata.version("sglang")


def pinned_sglang() -> str:
    """The SGLang release the whole suite runs on (constraints.txt)."""
    return _pins()["sglang"]


def _pins() -> dict[str, str]:
    """constraints.txt's own pins, above the GPU kit's (tests/test_gpu_kit.py checks those)."""
    text = (REPO / "constraints.txt").read_text().split(f"\n{KIT_PINS}")[0]
    return dict(line.split("==") for line in text.splitlines() if line and not line.startswith("#"))


@pytest.mark.every_release
def test_contract_holds_on_the_installed_sglang_live_and_from_source():
    assert contract.contract_problems(LiveSGLang()) == []
    assert contract.contract_problems(SourceSGLang(SITE, INSTALLED)) == []
    live = {seam: form.name for seam, form in contract.running_forms().items()}
    source = {
        seam: form.name for seam, form in contract.choose_forms(SourceSGLang(SITE, INSTALLED))[0].items()
    }
    assert live == source and set(live) == {variant.seam for variant in VARIANTS}


def _contract_files() -> list[str]:
    forms = [entry for variant in VARIANTS for form in variant.forms for entry in form.entries]
    modules = {
        e.module if isinstance(e, Named) else e.target.partition(":")[0] for e in [*contract.CONTRACT, *forms]
    }
    files = []
    for module in sorted(modules):
        relative = module.replace(".", "/")
        files += [f for f in (f"{relative}.py", f"{relative}/__init__.py") if (SITE / f).is_file()]
    return files


def _release_wheel(path: Path, file: str | None = None, old: str | None = None, new: str | None = None):
    """A wheel-like zip of the installed files the contract reads; ``file`` edited (or dropped)."""
    with zipfile.ZipFile(path, "w") as wheel:
        for name in _contract_files():
            text = (SITE / name).read_text()
            if name == file:
                if old is None:
                    continue
                assert old in text, f"the fault no longer applies to {name}: {old!r}"
                text = text.replace(old, new)
            wheel.writestr(name, text)
    return zipfile.ZipFile(path)


SOURCE_CHANGES = {
    "renamed method": (
        "sglang/srt/layers/logits_processor.py",
        "    def _get_logits(\n",
        "    def _get_logits_v2(\n",
        "LogitsProcessor._get_logits is not defined",
    ),
    "renamed parameter": (
        "sglang/srt/layers/vocab_parallel_embedding.py",
        "        tp_rank: int,\n        tp_size: int,\n    ) -> VocabParallelEmbeddingShardIndices:",
        "        rank: int,\n        tp_size: int,\n    ) -> VocabParallelEmbeddingShardIndices:",
        "VocabParallelEmbedding._get_indices takes classmethod (cls, vocab_size_padded, "
        "org_vocab_size_padded, vocab_size, org_vocab_size, rank, tp_size), not classmethod (cls, "
        "vocab_size_padded, org_vocab_size_padded, vocab_size, org_vocab_size, tp_rank, tp_size)",
    ),
    "parameters lost their defaults": (
        "sglang/srt/layers/logits_processor.py",
        "        embedding_bias: Optional[torch.Tensor] = None,\n        use_logits_buffer: bool = True,\n",
        "        embedding_bias: Optional[torch.Tensor],\n        use_logits_buffer: bool,\n",
        "LogitsProcessor._get_logits takes (self, hidden_states, lm_head, logits_metadata, "
        "embedding_bias, use_logits_buffer)",
    ),
    "instance attribute renamed": (
        "sglang/srt/speculative/eagle_worker_v2.py",
        "self.topk = get_spec().speculative_eagle_topk",
        "self.top_k = get_spec().speculative_eagle_topk",
        "EagleDraftWorker.topk is not defined",
    ),
    "server field renamed": (
        "sglang/srt/arg_groups/fields/spec.py",
        "    speculative_token_map: A[",
        "    speculative_token_maps: A[",
        "Spec.speculative_token_map is not defined",
    ),
    "enum member removed": (
        "sglang/srt/plugins/hook_registry.py",
        '    AFTER = "after"',
        "",
        "HookType.AFTER is not defined",
    ),
    "resolution step no longer overridable": (
        "sglang/srt/arg_groups/resolution_hooks.py",
        '"handle_speculative_decoding",',
        "",
        "_OVERRIDABLE_HOOKS no longer holds 'handle_speculative_decoding'",
    ),
    "dynamic name gone": (
        "sglang/srt/runtime_context.py",
        '"attn_tp_group"',
        '"attn_tp_grp"',
        "sglang.srt.runtime_context no longer names 'attn_tp_group'",
    ),
    "a seam in no known form": (
        "sglang/srt/layers/logits_processor.py",
        "        use_buffer: bool = True,\n        softcap: Optional[float] = None,\n",
        "        use_buffer: bool = True,\n        cap: Optional[float] = None,\n",
        "no known form of the softcap seam (as fused_with_copy: LogitsProcessor._copy_logits_to_buffer "
        "takes (self, logits, logits_metadata, use_buffer=, cap=), not (self, logits, logits_metadata, "
        "use_buffer=, softcap=) / as after_copy: ",
    ),
    "module removed": (
        "sglang/srt/plugins/hook_registry.py",
        None,
        None,
        "module sglang.srt.plugins.hook_registry does not exist",
    ),
}


def test_an_unchanged_copy_of_the_source_keeps_the_contract(tmp_path):
    assert contract.contract_problems(SourceSGLang(_release_wheel(tmp_path / "r.whl"), INSTALLED)) == []


@pytest.mark.parametrize("change", SOURCE_CHANGES)
def test_the_source_check_names_each_kind_of_change(tmp_path, change):
    file, old, new, expected = SOURCE_CHANGES[change]
    release = SourceSGLang(_release_wheel(tmp_path / "r.whl", file, old, new), "9.9.9")
    found = contract.contract_problems(release)
    assert any(expected in problem for problem in found), found


def test_an_older_release_takes_its_form_of_a_seam(tmp_path):
    """The source as SGLang 0.5.21 has it (no fused softcap in the logits copy): the contract holds
    and the softcap seam takes its older form, the others stay as installed."""
    old = "        use_buffer: bool = True,\n        softcap: Optional[float] = None,\n"
    wheel = _release_wheel(
        tmp_path / "r.whl", "sglang/srt/layers/logits_processor.py", old, "        use_buffer: bool = True,\n"
    )
    forms, unmatched = contract.choose_forms(SourceSGLang(wheel, "0.5.21-like"))
    assert unmatched == [] and contract.contract_problems(SourceSGLang(wheel, "0.5.21-like")) == []
    installed = contract.choose_forms(SourceSGLang(SITE, INSTALLED))[0]
    assert forms["softcap"].name == "after_copy" != installed["softcap"].name
    assert {k: f.name for k, f in forms.items() if k != "softcap"} == {
        k: f.name for k, f in installed.items() if k != "softcap"
    }


LIVE_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.ERROR, stream=sys.stdout, format="LOG %(name)s: %(message)s",
                    force=True)
fault, target, draft, token_map = sys.argv[1:]
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
if fault == "renamed method":
    LogitsProcessor._get_logits_v2 = LogitsProcessor._get_logits
    del LogitsProcessor._get_logits
elif fault == "changed signature":
    def _get_indices(cls, vocab_size_padded, org_vocab_size_padded, vocab_size, org_vocab_size, rank):
        raise AssertionError("not called")
    VocabParallelEmbedding._get_indices = classmethod(_get_indices)
from sglang.srt.arg_groups import resolution_hooks
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.server_args import ServerArgs
load_plugins()  # SGLang's own discovery: SGLANG_PLUGINS=frspec, then register(), then apply_hooks()
result = {"hooks": sorted(HookRegistry._hooks), "patched": sorted(HookRegistry._patched),
          "resolution": sorted(resolution_hooks._HOOKS)}
for tp in (1, 2):
    args = ServerArgs(model_path=target, tp_size=tp, device="cpu", speculative_algorithm="EAGLE",
                      speculative_draft_model_path=draft, speculative_token_map=token_map)
    try:
        args.resolve_once()
        result[f"tp{tp}"] = "resolved"
    except Exception as e:
        result[f"tp{tp}"] = f"{type(e).__name__}: {e}"
print("RESULT", json.dumps(result), flush=True)
"""


def _run_live(fault: str, perm, folder: Path) -> tuple[dict, list[str]]:
    env = cpu_env(1) | {"SGLANG_PLUGINS": "frspec"}
    args = [fault, perm.target, perm.draft, perm.token_map("hot")]
    status, output = run_python(LIVE_SCRIPT, args, env, folder / "live.log")
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    (result,) = [json.loads(line[len("RESULT ") :]) for line in lines if line.startswith("RESULT ")]
    return result, [line for line in lines if line.startswith("LOG sglang_frspec")]


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("renamed method", "LogitsProcessor._get_logits is not defined"),
        (
            "changed signature",
            "VocabParallelEmbedding._get_indices takes classmethod (cls, vocab_size_padded, "
            "org_vocab_size_padded, vocab_size, org_vocab_size, rank), not classmethod",
        ),
    ],
)
def test_a_changed_sglang_gets_no_hooks_and_a_token_map_at_tp2_is_refused(perm, fault, expected, tmp_path):
    result, log = _run_live(fault, perm, tmp_path)
    assert len(log) == 1, log
    assert f"does not support SGLang {INSTALLED}: {expected}" in log[0]
    assert result["hooks"] == [] and result["patched"] == []
    assert result["resolution"] == ["handle_speculative_decoding"]  # only the refusal
    assert result["tp1"] == "resolved"  # stock behaviour at TP=1
    assert result["tp2"].startswith("UnsupportedSetupError: sglang-frspec ")
    assert log[0].endswith(result["tp2"].split(": ", 1)[1])  # the logged line is the error


@pytest.mark.every_release
def test_register_installs_the_hook_table_and_the_contract_checks_every_target(perm, tmp_path):
    """register() installs exactly the targets of adapters/hooks.py for this SGLang's forms, and
    each is a contract Signature (a changed target then installs no hook instead of failing late)."""
    result, log = _run_live("none", perm, tmp_path)
    assert log == []
    assert result["tp2"] == "resolved" and result["hooks"], result
    forms = contract.running_forms()
    assert set(result["hooks"]) == {hook_target(h.target) for h in contract.active_hooks(forms)}
    checked = contract.CONTRACT + tuple(entry for form in forms.values() for entry in form.entries)
    hooked = {hook_target(e.target) for e in checked if isinstance(e, Signature)}
    assert set(result["hooks"]) <= hooked, set(result["hooks"]) - hooked
    assert set(result["patched"]) == set(result["hooks"])
    steps = {e.value for e in contract.CONTRACT if isinstance(e, Contains)}
    assert set(result["resolution"]) <= steps


def test_pyproject_declares_a_range_without_torch_and_constraints_pin_what_is_installed():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = [Requirement(r) for r in project["project"]["dependencies"]]
    assert [r.name for r in requirements] == ["sglang"]  # no torch of its own: SGLang pins it
    (sglang,) = requirements
    pins = _pins()
    assert {"sglang", "torch"} <= set(pins)
    for name in set(pins) - {"sglang", "torch"}:  # the test extra's pins (the real model's packages)
        assert importlib.metadata.version(name) == pins[name], name
    assert sglang.specifier.contains(pins["sglang"])
    major, minor, *_ = pins["sglang"].split(".")
    assert not sglang.specifier.contains(f"{major}.{int(minor) + 1}.0")  # below the next minor
    import torch

    assert pins["sglang"] == INSTALLED and torch.__version__.split("+")[0] == pins["torch"]
    # One source for the version: setuptools reads sglang_frspec.__version__.
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sglang_frspec.__version__"}


def test_readme_compatibility_table_matches_the_check_of_the_installed_release():
    """CI regenerates the whole table over every release in range; offline, the installed one."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- sglang-compat:begin -->\n(.*?)\n<!-- sglang-compat:end -->", readme, re.DOTALL)
    assert block, "README.md lacks the compatibility table markers"
    readme_lines = block.group(1).splitlines()
    source = SourceSGLang(SITE, INSTALLED)
    (torch_pin,) = [
        r.split("==")[1] for r in importlib.metadata.requires("sglang") if r.startswith("torch==")
    ]
    release = contract.ReleaseCheck(
        INSTALLED,
        torch_pin,
        contract.contract_problems(source),
        {seam: form.name for seam, form in contract.choose_forms(source)[0].items()},
    )
    generated = contract.compatibility_table([release], release_test_runs([INSTALLED])).splitlines()
    assert readme_lines[:2] == generated[:2]
    assert [line for line in readme_lines if line.startswith(f"| {INSTALLED} |")] == generated[2:]
