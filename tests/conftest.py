"""Shared fixtures: CPU SGLang environment, cached models, servers whose logs join failures."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import settings

from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, CPU_SITE, cpu_env, eagle_args
from sglang_frspec.demo.fixtures import LLAMA3_VOCAB, cache_root, perm_fixture
from sglang_frspec.demo.server import Launch, SGLangServer, kill_tree
from tests.harness.gpu_defaults.overlap import SITE as GPU_DEFAULTS_SITE
from tests.harness.gpu_defaults.overlap import overlap_env, ranks_not_under_overlap
from tools.serving.zygote import ZYGOTES_STARTED, forked_launch

REPO = Path(__file__).resolve().parent.parent

# In-process SGLang imports (plan-vs-SGLang checks) need the same CPU environment as servers.
for _key, _value in cpu_env(1).items():
    if _key.startswith(("SGLANG_", "TORCHDYNAMO")):
        os.environ.setdefault(_key, _value)
sys.path.insert(0, str(CPU_SITE))
# Importing sglang sets its third-party cache variables in os.environ (TRITON_CACHE_DIR and others,
# sglang/__init__.py). Done here, before any zygote starts, the environment every zygote is keyed on
# stays the same all session; done by the first test that imports SGLang, it changed the key of
# every later zygote (each a new ~20 s import). The session imports SGLang anyway.
import sglang  # noqa: E402, F401

from tests.harness.config_parser import SITE as CONFIG_PARSER_SITE  # noqa: E402 (imports SGLang)
from tests.harness.draft_probe import PROBE_SITE  # noqa: E402

# Rank processes of run_tp_group import tests.rank_cases; every process finds the test plugins'
# entry points (the overlap plugin, the config parser, the draft probe, the benchmarks' cycle
# profiler: each loaded where SGLANG_PLUGINS names it), so PYTHONPATH is the same for all zygotes.
_PLUGIN_SITES = [GPU_DEFAULTS_SITE, CONFIG_PARSER_SITE, PROBE_SITE, REPO / "benchmarks" / "profile_site"]
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(REPO), *map(str, _PLUGIN_SITES), os.environ.get("PYTHONPATH")])
)

# A failing property test prints the blob that replays it; in CI the examples are derived from
# each test's source (derandomize), so a CI failure reproduces on any machine.
settings.register_profile("default", print_blob=True)
settings.register_profile("ci", print_blob=True, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true") else "default")

OPTION_PREFIX = "SGLANG_FRSPEC_"


def _option_vars() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(OPTION_PREFIX)}


@pytest.fixture(autouse=True)
def no_option_leaks():
    """Fail a test that leaves any SGLANG_FRSPEC_* variable changed: every later server
    and engine inherits os.environ, so a leak silently changes what they test."""
    before = _option_vars()
    yield
    after = _option_vars()
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        os.environ.update(before)
        for key in after.keys() - before.keys():
            del os.environ[key]
        pytest.fail(f"test left {', '.join(changed)} changed in os.environ (restored now)", pytrace=False)


@pytest.fixture
def options_unset(monkeypatch):
    """Every option variable unset for the test and restored after it, even when the test (or
    ``set_options``) writes them: ``delenv`` alone records nothing for a variable that is not set,
    so ``setenv`` first makes monkeypatch remember the variable's prior state."""
    from sglang_frspec.core.options import OPTION_ENVS

    for name in OPTION_ENVS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture(scope="session")
def perm():
    """The permutation fixture (V=32000)."""
    return perm_fixture()


@pytest.fixture(scope="session")
def perm_llama3():
    """The permutation fixture with a Llama-3-size vocab (V=128256)."""
    return perm_fixture(vocab_size=LLAMA3_VOCAB)


_SERVERS_KEY = pytest.StashKey[list]()
# Every server the fixtures made, with the test that made it: the session's closing summary
# reports their start-up times (where a server test's time goes; docs/testing.md).
_SERVERS_MADE: list[tuple[str, SGLangServer]] = []
# The servers made with overlap=True: each must have decoded under the overlap scheduler, if it
# decoded at all (``servers_decoded_under_overlap``).
_OVERLAP_SERVERS: list[SGLangServer] = []


def fixture_server_args(
    fixture, tp: int, token_map: str | None = None, *, extra: tuple = (), eagle: bool = True
) -> list[str]:
    """``sglang.launch_server``'s arguments for ``fixture_server``."""
    args = ["--model-path", fixture.target, "--tp-size", str(tp), *CPU_SERVER_ARGS]
    if eagle:
        args += eagle_args(fixture.draft, token_map)
    return args + list(extra)


def fixture_server(
    fixture,
    tp: int,
    log_path: Path,
    token_map: str | None = None,
    *,
    plugin: bool = True,
    extra: tuple = (),
    env: dict | None = None,
    eagle: bool = True,
    overlap: bool = True,
    launch: Launch = forked_launch,
) -> SGLangServer:
    """A (not yet started) CPU ``sglang.launch_server`` of a fixture's target (and EAGLE draft);
    ``env`` adds variables to (never replaces) this process's environment. Speculative decoding
    runs with the overlap scheduler on, as on a GPU (``tests/harness/gpu_defaults/overlap.py``);
    ``overlap=False`` keeps SGLang's CPU configuration (overlap off). The launcher is forked from
    a zygote (``forked_launch``); ``launch=new_python`` starts a new Python."""
    args = fixture_server_args(fixture, tp, token_map, extra=extra, eagle=eagle)
    env = cpu_env(tp, with_plugin=plugin, base=os.environ | (env or {}))
    env = overlap_env(env) if overlap else env
    server = SGLangServer(args, env, log_path, launch=launch)
    if overlap:
        _OVERLAP_SERVERS.append(server)
    _SERVERS_MADE.append((os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], server))
    return server


@pytest.fixture
def start_server(request, tmp_path):
    """``start_server(fixture, tp, token_map=None, *, wait=True, **options)``, ``options`` as
    ``fixture_server``'s (plugin, extra, env, eagle).

    Starts a real ``sglang.launch_server`` and waits until it is ready (``wait=False``: returns
    it started); every server is stopped after the test (each on its own, also when another's stop
    fails or it already exited). A failing test gets every server's log tail attached to its report.
    """
    servers: list[SGLangServer] = []
    request.node.stash[_SERVERS_KEY] = servers
    teardown = contextlib.ExitStack()

    def start(fixture, tp: int, token_map: str | None = None, *, wait: bool = True, **options):
        server = fixture_server(fixture, tp, tmp_path / f"server{len(servers)}.log", token_map, **options)
        servers.append(server)
        teardown.callback(server.stop)
        server.start()
        return server.wait_ready() if wait else server

    with teardown:
        yield start


@pytest.fixture(autouse=True)
def servers_decoded_under_overlap():
    """Fail a test whose ``overlap=True`` server decoded with the overlap scheduler off (or, if
    speculative, without relaying its draft inputs): its tests pass under the CPU's loop as well,
    so only the log shows that the GPU's loop did not run. Checked after the test, once its
    servers are stopped (an autouse fixture is finalized after ``start_server``)."""
    made_before = len(_OVERLAP_SERVERS)
    yield
    for server in _OVERLAP_SERVERS[made_before:]:
        if server.started_at is None:
            continue
        ranks = ranks_not_under_overlap(server.log(), "--speculative-algorithm" in server.args)
        if ranks:
            pytest.fail(
                f"{server.log_path}: TP rank(s) {ranks} decoded without the overlap scheduler (or "
                "its draft-input relay); a server that runs with overlap off must say overlap=False",
                pytrace=False,
            )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    servers = item.stash.get(_SERVERS_KEY, [])
    if report.failed and call.when == "call":
        for i, server in enumerate(servers):
            tail = server.log_path.read_text(errors="replace").splitlines()[-80:]
            report.sections.append((f"server {i} log ({server.log_path})", "\n".join(tail)))
    return report


# Fixtures that take minutes to build, by the test files that use them, the quicker build first.
# A session that collects such a file starts the build at once, in a Python of its own at the
# lowest priority: it runs on the core time the tests leave idle (the server tiers leave about a
# quarter), and the first test that needs the fixture waits for it on cached_build's lock instead
# of building it again. Logs: <cache>/background-builds/.
BACKGROUND_BUILDS = {
    "sglang_frspec.demo.gemma3.gemma3_checks": ("test_gemma3.py",),  # the fixture, then its checks
    "tools.draft_training.trained_fixture.trained_fixture": ("test_trained.py", "test_benchmarks.py"),
}
_BACKGROUND_BUILDERS: list[subprocess.Popen] = []
# The builder's session is an autogroup of its own where the kernel schedules by autogroup
# (/proc/sys/kernel/sched_autogroup_enabled), and nice ranks a process only within its group, so
# `nice -n 19` alone gave the build a full share beside the tests' sessions (measured: a spinning
# loop at nice 19 in its own session took half a shared core; with its group at nice 19, 3%).
_LOWEST_PRIORITY = (
    "import contextlib, pathlib\n"
    "with contextlib.suppress(OSError): pathlib.Path('/proc/self/autogroup').write_text('19')\n"
)


def _tier(item: pytest.Item) -> int:
    return 2 if item.get_closest_marker("server") else 1 if item.get_closest_marker("multirank") else 0


def _build_needed(item: pytest.Item) -> int:
    """1 + the index of the background build ``item``'s file waits for, 0 for none."""
    users = list(BACKGROUND_BUILDS.values())
    return next((i + 1 for i, files in enumerate(users) if item.path.name in files), 0)


def pytest_collection_modifyitems(items):
    """Unit tests first, then the gloo TP groups, then real servers (stable within a tier): a
    broken build fails in the first minutes of a run instead of after the servers. The files that
    wait for a background build run after all of them, so the build has the other tests' idle
    core time to finish in."""
    items.sort(key=lambda item: (_build_needed(item), _tier(item)))


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    files = {item.path.name for item in session.items}
    for builder, users in BACKGROUND_BUILDS.items():
        if files.isdisjoint(users):
            continue
        module, function = builder.rsplit(".", 1)
        log = cache_root() / "background-builds" / f"{function}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            builder_process = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, "-c", f"{_LOWEST_PRIORITY}import {module}; {builder}()"],
                # One thread: two OpenMP teams on two cores spin at their barriers while a peer
                # thread is descheduled, so a two-thread build beside the tests wastes the core
                # time it takes from them.
                env=os.environ | {"OMP_NUM_THREADS": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # kill_tree ends it with its children
            )
        _BACKGROUND_BUILDERS.append(builder_process)


def pytest_sessionfinish(session):
    """A build still running when the session ends (a failed or partial run) is stopped."""
    for builder_process in _BACKGROUND_BUILDERS:
        if builder_process.poll() is None:
            kill_tree(builder_process.pid, graceful=False)


_SESSION_START = time.monotonic()
_ITEM_SECONDS: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _ITEM_SECONDS[report.nodeid] += report.duration  # setup + call + teardown


def pytest_terminal_summary(terminalreporter):
    """The suite's budget at a glance: total time, the ten slowest tests (setup, call and
    teardown together), the time per file and the server start-ups (docs/testing.md says how to
    read them)."""
    write = terminalreporter.write_line
    terminalreporter.section("time budget")
    write(f"pytest wall time {time.monotonic() - _SESSION_START:.0f} s over {len(_ITEM_SECONDS)} tests")
    for nodeid, seconds in sorted(_ITEM_SECONDS.items(), key=lambda kv: -kv[1])[:10]:
        write(f"{seconds:8.1f} s  {nodeid}")
    per_file: defaultdict[str, float] = defaultdict(float)
    for nodeid, seconds in _ITEM_SECONDS.items():
        per_file[nodeid.split("::")[0]] += seconds
    write("per file:")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
        write(f"{seconds:8.1f} s  {path}")
    starts = [(test, s.ready_after) for test, s in _SERVERS_MADE if s.ready_after is not None]
    if starts:
        total = sum(seconds for _, seconds in starts)
        write(f"server start-ups: {len(starts)}, {total:.0f} s, {total / len(starts):.1f} s on average")
        for test, seconds in sorted(starts, key=lambda ts: -ts[1])[:5]:
            write(f"{seconds:8.1f} s  start-up in {test}")
    if ZYGOTES_STARTED:
        write(f"zygotes started: {len(ZYGOTES_STARTED)} (each preloads SGLang, ~20 s; new because of)")
        for preload, changed in ZYGOTES_STARTED:
            write(f"  {preload}: {', '.join(changed) or 'the first'}")
