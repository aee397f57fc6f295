"""Shared fixtures: CPU SGLang environment, cached models, servers whose logs join failures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sglang_frspec.testing.cpu import CPU_SERVER_ARGS, CPU_SITE, cpu_env, eagle_args
from sglang_frspec.testing.fixtures import LLAMA3_VOCAB, perm_fixture
from sglang_frspec.testing.server import SGLangServer

REPO = Path(__file__).resolve().parent.parent

# In-process SGLang imports (plan-vs-SGLang checks) need the same CPU environment as servers.
for _key, _value in cpu_env(1).items():
    if _key.startswith(("SGLANG_", "TORCHDYNAMO")):
        os.environ.setdefault(_key, _value)
sys.path.insert(0, str(CPU_SITE))
# Rank processes of run_tp_group import tests.rank_cases.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def perm():
    """The permutation fixture (V=32000)."""
    return perm_fixture()


@pytest.fixture(scope="session")
def perm_llama3():
    """The permutation fixture with a Llama-3-size vocab (V=128256)."""
    return perm_fixture(vocab_size=LLAMA3_VOCAB)


_SERVERS_KEY = pytest.StashKey[list]()


@pytest.fixture
def start_server(request, tmp_path):
    """``start_server(fixture, tp, token_map=None, plugin=True, extra=(), env=None)``.

    Starts a real ``sglang.launch_server`` and waits until it is ready; stopped after the test.
    A failing test gets every server's log tail attached to its report.
    """
    servers: list[SGLangServer] = []
    request.node.stash[_SERVERS_KEY] = servers

    def start(
        fixture,
        tp: int,
        token_map: str | None = None,
        *,
        plugin: bool = True,
        extra: tuple = (),
        env: dict | None = None,
        wait: bool = True,
        eagle: bool = True,
    ) -> SGLangServer:
        args = ["--model-path", fixture.target, "--tp-size", str(tp), *CPU_SERVER_ARGS]
        if eagle:
            args += eagle_args(fixture.draft, token_map)
        args += list(extra)
        server = SGLangServer(
            args, cpu_env(tp, with_plugin=plugin, base=env), tmp_path / f"server{len(servers)}.log"
        )
        servers.append(server)
        server.start()
        return server.wait_ready() if wait else server

    yield start
    for server in servers:
        server.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    servers = item.stash.get(_SERVERS_KEY, [])
    if report.failed and call.when == "call":
        for i, server in enumerate(servers):
            tail = server.log_path.read_text(errors="replace").splitlines()[-80:]
            report.sections.append((f"server {i} log ({server.log_path})", "\n".join(tail)))
    return report
