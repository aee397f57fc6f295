"""Offline ``sglang.Engine`` (in a child process): the drop-in worker class, weight updates."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from sglang_frspec.demo.cpu import cpu_env
from tests.harness.engine import run_engine

pytestmark = pytest.mark.server
NEW = 24


def engine_kwargs(fixture, tp: int, token_map: str) -> dict:
    """The Engine twin of CPU_SERVER_ARGS + eagle_args."""
    return {
        "model_path": fixture.target, "tp_size": tp, "device": "cpu", "attention_backend": "intel_amx",
        "max_total_tokens": 8192, "disable_cuda_graph": True, "log_level": "error",
        "speculative_algorithm": "EAGLE", "speculative_draft_model_path": fixture.draft,
        "speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4,
        "speculative_token_map": token_map,
    }  # fmt: skip


def greedy(prompt: list[int]) -> dict:
    return {"generate": {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}}


def test_drop_in_worker_class_without_the_plugin(perm, tmp_path):
    """A user's own plugin installs ShardedFRSpecEagleDraftWorker with a class REPLACE hook;
    this project's `frspec` plugin is not loaded at all."""
    (tmp_path / "dropin_user_plugin.py").write_text(
        "def register():\n"
        "    from sglang.srt.plugins.hook_registry import HookRegistry, HookType\n"
        "    from sglang_frspec import ShardedFRSpecEagleDraftWorker\n"
        "    HookRegistry.register('sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker',\n"
        "                          ShardedFRSpecEagleDraftWorker, HookType.REPLACE)\n"
    )
    dist = tmp_path / "dropin_user_plugin-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dropin-user-plugin\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\ndropin = dropin_user_plugin:register\n")
    env = cpu_env(2, with_plugin=False)
    env["SGLANG_PLUGINS"] += ",dropin"
    prompt = list(perm.chain[:3])
    kwargs = engine_kwargs(perm, 2, perm.token_map("hot"))
    [out] = run_engine(kwargs, [greedy(prompt)], env, tmp_path, import_paths=(str(tmp_path),))
    assert out["output_ids"] == list(perm.chain[3 : 3 + NEW])
    assert out["meta_info"]["spec_accept_length"] == 3.0


def test_update_weights_from_tensor_refreshes_the_hot_head(perm, tmp_path):
    tensors = load_file(os.path.join(perm.target, "model.safetensors"))
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    hot = torch.load(perm.token_map("hot"))
    tau = hot[torch.randperm(hot.numel(), generator=torch.Generator().manual_seed(5))]
    new_head = head.clone()
    new_head[hot] = head[tau]  # greedy becomes x -> tau^-1(pi(x)), still inside the hot set
    torch.save(new_head, tmp_path / "lm_head.pt")
    prompt = list(perm.chain[:3])
    expected = []  # independent reference: the target's hidden state is RMSNorm(embed(x))
    for _ in range(NEW):
        expected.append(int((embed[(expected or prompt)[-1]] @ new_head.T).argmax()))
    assert expected != list(perm.chain[3 : 3 + NEW])

    steps = [greedy(prompt), {"update_lm_head": str(tmp_path / "lm_head.pt")}, greedy(prompt)]
    before, update, after = run_engine(
        engine_kwargs(perm, 2, perm.token_map("hot")), steps, cpu_env(2), tmp_path
    )
    assert before["meta_info"]["spec_accept_length"] == 3.0
    assert update[0] is True, update
    assert after["output_ids"] == expected
    assert after["meta_info"]["spec_accept_length"] == 3.0  # a stale hot head would draft old pi(x)
