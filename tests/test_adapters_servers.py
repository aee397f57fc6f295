"""Real TP=2 servers for the adapters' less common paths: a draft config whose vocab field
disagrees with the map, a target config only SGLang (not AutoConfig) can read, and NEXTN."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.server import SGLangServer
from tests.harness.config_parser import CONFIG_NAME
from tests.harness.config_parser import PLUGIN as PARSER_PLUGIN
from tests.test_servers_plugin import generate_chains
from tools.serving.zygote import forked_launch

pytestmark = [pytest.mark.server, pytest.mark.multirank]
EXIT_TIMEOUT = 240  # seconds a failing start-up may take before we call it a hang


def _failed_through_agreement(log: str, message: str) -> None:
    """The error went through the plugin's collective agreement step on the TP CPU group: a
    rank raises "[sglang-frspec, TP rank r of 2] ..." only after every rank joined that
    all-gather with its own status, so every rank raises it. (The launcher kills the tree at
    the first scheduler failure, so a second traceback is not always printed.)"""
    raised = [line for line in log.splitlines() if "Error: [sglang-frspec, TP rank " in line]
    assert raised, "no agreed sglang-frspec error in the log"
    assert all(" of 2] " in line and message in line for line in raised), raised
    assert re.search(r"TP[01]\] Scheduler hit an exception", log)


def test_draft_vocab_size_unlike_the_map_fails_on_every_rank(perm, start_server, tmp_path):
    """Found only once the draft is loaded (init_lm_head): every rank raises; the server exits."""
    num_hot = len(set(torch.load(perm.token_map("hot")).tolist()))
    draft = tmp_path / "eagle-draft-vocab"
    shutil.copytree(perm.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"draft_vocab_size": num_hot + 8}))
    server = start_server(perm, 2, perm.token_map("hot"), wait=False,
                          extra=("--speculative-draft-model-path", str(draft)))  # fmt: skip
    assert server.wait_exit(EXIT_TIMEOUT) != 0
    log = server.log_path.read_text()
    _failed_through_agreement(
        log, f"the draft config sets draft_vocab_size={num_hot + 8}, but the token map has {num_hot}"
    )
    assert "Remove draft_vocab_size from the draft's config.json" in log


def _renamed_config_target(perm, tmp_path) -> str:
    """A copy of the target whose config only the ``renamed_config`` plugin's parser
    (``--model-config-parser renamed``, tests/harness/config_parser.py) reads."""
    target = tmp_path / "renamed-config-target"
    shutil.copytree(perm.target, target)
    (target / "config.json").rename(target / CONFIG_NAME)
    return str(target)


def test_unreadable_target_config_defers_the_map_check_to_every_rank(perm, tmp_path):
    """AutoConfig cannot read the target's config at argument time, SGLang can (through a
    registered --model-config-parser): the launcher's check passes the map through, and the
    schedulers' check against the real head rejects its out-of-range id on every rank."""
    from sglang_frspec.adapters.args import _target_vocab_size

    target = _renamed_config_target(perm, tmp_path)
    readable = SimpleNamespace(model_path=perm.target, trust_remote_code=False, revision=None)
    assert _target_vocab_size(readable) == perm.vocab_size
    assert _target_vocab_size(SimpleNamespace(**vars(readable) | {"model_path": target})) is None
    bad_map = tmp_path / "too_big.pt"
    torch.save(torch.tensor([5, perm.vocab_size + 8000]), bad_map)

    env = cpu_env(2)
    env["SGLANG_PLUGINS"] += f",{PARSER_PLUGIN}"  # its entry point is on every test process's path
    args = ["--model-path", target, "--tp-size", "2", *CPU_SERVER_ARGS, "--model-config-parser", "renamed",
            *eagle_args(perm.draft, str(bad_map))]  # fmt: skip
    # Forked from the zygote the suite's servers use (the plugin's site is on every process's path).
    server = SGLangServer(args, env, tmp_path / "server.log", launch=forked_launch).start()
    try:
        status = server.wait_exit(EXIT_TIMEOUT)
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert status != 0, log[-3000:]
    assert "Load weight begin" in log, log[-3000:]  # past argument time: SGLang read the config
    _failed_through_agreement(log, f"1 id(s) >= the target's vocab size {perm.vocab_size}")


def test_nextn_with_a_map_at_tp2_follows_pi_with_full_acceptance(perm, start_server):
    """SGLang resolves NEXTN to EAGLE before the plugin's argument check; the Llama EAGLE draft
    keeps its architecture, so NEXTN + map serves exactly as EAGLE + map."""
    server = start_server(perm, 2, perm.token_map("hot"), extra=("--speculative-algorithm", "NEXTN"))
    assert generate_chains(server, perm.chain) == [3.0, 3.0, 3.0]
    log = server.log_path.read_text()
    assert "--speculative-algorithm NEXTN" in log.splitlines()[0]  # the command really asked for NEXTN
    num_hot = len(set(torch.load(perm.token_map("hot")).tolist()))
    assert f"sglang-frspec: {num_hot} hot ids over 2 rank(s)" in log
