"""The zygote's children behave as ``python -m module`` processes would (exit status, output,
session, environment, argv), checked on a small module of the test's own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from sglang_frspec.demo.cpu import cpu_env
from sglang_frspec.demo.server import kill_tree
from tests.harness.forked_python import run_python
from tools.serving.zygote import close_zygotes, fork_module, zygote_for

# A launcher whose multiprocessing children are forked (fork_children): it runs an OpenMP parallel
# torch op, then a child runs one too.
OPENMP_LAUNCHER = """
import multiprocessing, sys, torch
def parallel_op():
    return float(torch.ones(1 << 22).mul(2.0).sum())  # far above torch's grain: a parallel region
parallel_op()
child = multiprocessing.Process(target=parallel_op)
child.start()
child.join(60)
print("threads", torch.get_num_threads(), "child exit", child.exitcode, flush=True)
if child.exitcode is None:
    child.kill()
sys.exit(0 if child.exitcode == 0 else 1)
"""

CHILD = """
import json, os, sys, time
import preloaded_marker
mode = sys.argv[1]
print(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "pgid": os.getpgid(0),
                  "marker": os.environ.get("ZYGOTE_MARKER"), "loaded_at": preloaded_marker.LOADED_AT,
                  "layout": os.environ.get("SGLANG_FRSPEC_LAYOUT"),
                  "main": __name__, "file": __file__}), flush=True)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("raised in the child")
if mode == "sleep":
    time.sleep(60)
"""


@pytest.fixture(autouse=True)
def close_the_tests_zygotes():
    """Each test's zygotes (one per tmp_path) are closed after it, not left to evict the suite's."""
    yield
    close_zygotes(("preloaded_marker",))
    close_zygotes(())


@pytest.fixture
def zygote(tmp_path):
    (tmp_path / "zygote_child.py").write_text(CHILD)
    (tmp_path / "preloaded_marker.py").write_text("import os\nLOADED_AT = os.getpid()\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), ZYGOTE_MARKER=str(tmp_path))
    return zygote_for(env, ("preloaded_marker",))


def _report(log) -> dict:
    """The child's JSON line (the log may also hold a header and a traceback)."""
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


def test_child_runs_the_module_as_main_with_its_argv_env_and_session(zygote, tmp_path):
    log = tmp_path / "ok.log"
    log.write_text("header\n")
    child = zygote.run_module("zygote_child", ["exit", "0"], log, {})
    assert child.wait(timeout=30) == 0
    lines = log.read_text().splitlines()
    assert lines[0] == "header"  # appended, as SGLangServer's command line stays first
    report = _report(log)
    assert report["argv"] == ["exit", "0"] and report["main"] == "__main__"
    assert report["file"] == str(tmp_path / "zygote_child.py")
    assert report["marker"] == str(tmp_path)  # the zygote's environment
    assert report["pid"] == child.pid == report["pgid"] != os.getpid()  # its own session
    assert report["loaded_at"] == zygote.proc.pid  # preloaded once, in the zygote, not re-imported


def test_exit_status_is_the_childs_own(zygote, tmp_path):
    assert zygote.run_module("zygote_child", ["exit", "3"], tmp_path / "three.log", {}).wait(timeout=30) == 3
    raised = zygote.run_module("zygote_child", ["raise"], tmp_path / "raise.log", {})
    assert raised.wait(timeout=30) == 1
    assert "ValueError: raised in the child" in (tmp_path / "raise.log").read_text()


def test_a_signalled_child_reports_the_signal_and_poll_sees_it_running_before(zygote, tmp_path):
    child = zygote.run_module("zygote_child", ["sleep"], tmp_path / "sleep.log", {})
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=1.0)
    assert child.poll() is None
    kill_tree(child.pid, graceful=False)
    assert child.wait(timeout=30) == -signal.SIGKILL
    terminated = zygote.run_module("zygote_child", ["sleep"], tmp_path / "term.log", {})
    terminated.send_signal(signal.SIGTERM)
    assert terminated.wait(timeout=30) == -signal.SIGTERM
    terminated.send_signal(signal.SIGTERM)  # a no-op once it has exited, as Popen's


def test_children_of_one_environment_share_a_zygote_and_a_new_environment_gets_its_own(zygote, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(tmp_path), ZYGOTE_MARKER=str(tmp_path))
    assert zygote_for(env, ("preloaded_marker",)) is zygote
    other = zygote_for(dict(env, ZYGOTE_MARKER="other"), ("preloaded_marker",))
    assert other is not zygote
    log = tmp_path / "other.log"
    assert other.run_module("zygote_child", ["exit", "0"], log, {}).wait(timeout=30) == 0
    assert _report(log)["marker"] == "other"
    assert _report(log)["loaded_at"] == other.proc.pid != zygote.proc.pid


@pytest.mark.usefixtures("zygote")  # writes the modules
def test_late_variables_reach_the_child_and_share_one_zygote(tmp_path):
    """Environments that differ only in LATE_VARIABLES fork from one zygote started without them;
    each child sees its own values."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path), ZYGOTE_MARKER=str(tmp_path))
    reports = {}
    for layout in ("local", "balanced"):
        log = tmp_path / f"{layout}.log"
        child = fork_module(env | {"SGLANG_FRSPEC_LAYOUT": layout}, ("preloaded_marker",), "zygote_child",
                            ["exit", "0"], log)  # fmt: skip
        assert child.wait(timeout=30) == 0
        reports[layout] = _report(log)
    assert [r["layout"] for r in reports.values()] == ["local", "balanced"]
    # Both preloaded the marker in one process, neither child itself: one zygote.
    assert reports["local"]["loaded_at"] == reports["balanced"]["loaded_at"]
    assert reports["local"]["loaded_at"] not in (reports["local"]["pid"], reports["balanced"]["pid"])


SPAWNER = """
import json, multiprocessing as mp, sys


def report(queue):
    queue.put({"method": mp.get_start_method(), "inherited": "already_imported" in sys.modules})


if __name__ == "__main__":
    import already_imported  # noqa: F401
    mp.set_start_method("spawn", force=True)  # as SGLang's launcher does
    queue = mp.Queue()
    process = mp.Process(target=report, args=(queue,))
    process.start()
    print(json.dumps(queue.get(timeout=60)), flush=True)
    process.join()
"""


@pytest.mark.parametrize("fork_children", [False, True])
def test_fork_children_starts_multiprocessing_children_by_fork_despite_spawn(zygote, tmp_path, fork_children):
    """With ``fork_children`` a launcher's children are forked from it (they inherit its imports);
    without, they are spawned as the module asks (a new Python, nothing inherited)."""
    (tmp_path / "zygote_spawner.py").write_text(SPAWNER)
    (tmp_path / "already_imported.py").write_text("")
    log = tmp_path / "spawner.log"
    child = zygote.run_module("zygote_spawner", [], log, {}, fork_children=fork_children)
    assert child.wait(timeout=120) == 0, log.read_text()
    report = _report(log)
    assert report == {"method": "fork" if fork_children else "spawn", "inherited": fork_children}


def test_forked_children_of_a_launcher_that_ran_openmp_do_not_hang(tmp_path):
    """GNU OpenMP is not fork-safe: without the launcher's single-thread setting the child waits
    forever in its first parallel region (joined for 60 s here, then the launcher exits 1)."""
    import torch

    if torch.get_num_threads() < 2:
        pytest.skip("one CPU thread: no OpenMP pool to inherit")
    (tmp_path / "openmp_launcher.py").write_text(OPENMP_LAUNCHER)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    log = tmp_path / "openmp.log"
    child = fork_module(env, (), "openmp_launcher", [], log, fork_children=True)
    assert child.wait(timeout=120) == 0, log.read_text()[-2000:]
    assert "threads 1 child exit 0" in log.read_text()  # the launcher single-threaded, its child done


def test_a_forked_python_c_child_gets_argv_and_exit_status_and_is_killed_at_its_timeout(tmp_path):
    """tests/harness/forked_python.py: ``python -c`` semantics (argv, __name__, exit status, output)
    from the SGLang zygote; past its timeout the child's session is killed, not left running."""
    code = "import sys; print(sys.argv, __name__); sys.exit(3)"
    status, output = run_python(code, ["a", "b"], cpu_env(1), tmp_path / "exit.log")
    assert (status, output) == (3, "['-c', 'a', 'b'] __main__\n")

    sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(sleeper, [str(pid_file)], cpu_env(1), tmp_path / "sleep.log", timeout=3)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    with contextlib.suppress(psutil.NoSuchProcess):  # gone: reaped by the zygote
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the timed-out child still runs"
            time.sleep(0.1)
