"""Fork test and benchmark processes from a Python that has already imported SGLang (a *zygote*).

Importing SGLang costs about 10 s of a 2-core machine, and the suite starts well over a hundred
processes that each begin with that import. ``fork_module(env, preload, module, args, log)``
starts (once per environment and preload list) a Python with ``env`` that imports ``preload``
and waits, then forks it: the child runs ``python -m module *args`` (``runpy``, as ``__main__``)
in a session of its own, ``log`` as its stdout and stderr (``stderr_log``, if given, as its
stderr), with exactly ``env`` (a few variables that no preloaded module reads at import,
``LATE_VARIABLES``, are set after the fork). The child is a new process that is as if started
from scratch and paused after those imports: its own pid, session, SGLang state and
``multiprocessing`` children; only the import work is shared (and, for a server's launcher, its
schedulers fork from it: ``_fork_multiprocessing_children``).
``ForkedProcess`` answers ``pid``, ``poll``, ``wait``, ``send_signal`` and ``returncode`` as
``subprocess.Popen`` does (the zygote reaps its children and records their exit status).
``forked_launch`` is an ``SGLangServer`` launch that forks the server's launcher this way.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sglang_frspec.demo.cpu import pythonpath_with
from sglang_frspec.demo.server import LAUNCHER

REPO = Path(__file__).resolve().parents[2]
MAX_ZYGOTES = 6  # each holds an imported SGLang (~0.5 GB); the least recently used goes beyond this
# Left out of a zygote's environment: pytest changes it at every test phase, and no child reads it.
PER_TEST_VARIABLES = ("PYTEST_CURRENT_TEST",)
# Set in the child, after the fork, so that one zygote serves every value: no module a zygote
# preloads reads them at import (SGLang reads SGLANG_PLUGINS in load_plugins and the thread binding
# when a rank starts, sglang 0.5.23 plugins/__init__.py, utils/numa_utils.py; this plugin reads its
# SGLANG_FRSPEC_* options in FrSpecOptions.from_env; the CPU site reads SGL_SHIM_LOG at each op
# call, cpu_site/sgl_kernel/__init__.py _log; SGLang reads SGLANG_MAMBA_CONV_DTYPE when a model's
# config builds its state dtypes, configs/mamba_utils.py:68 mamba2_state_dtype). One is read at
# import: SGLANG_EXTERNAL_MODEL_PACKAGE, by the model registry (models/registry.py:154), which the
# launcher's zygote preloads; the child registers that package as the import would have
# (_register_external_models). Prefixes end with "_".
LATE_VARIABLES = (
    "SGLANG_PLUGINS",
    "SGLANG_CPU_OMP_THREADS_BIND",
    "SGLANG_FRSPEC_",
    "SGL_SHIM_LOG",
    "SGLANG_MAMBA_CONV_DTYPE",
    "SGLANG_EXTERNAL_MODEL_PACKAGE",
)


# What the launcher imports before it loads plugins (sglang 0.5.23 launch_server.py), then the HTTP
# server it imports after them (~9.5 s) and the model registry each scheduler imports (it imports
# every model module, ~3.6 s): together most of a forked server's start-up. Importing the last two
# before the plugin loads is safe because every hook in adapters/hooks.py is set on a class
# attribute, which SGLang looks up at call time whatever was imported first
# (srt/plugins/hook_registry.py:290); the fresh order is what new-Python launches run (the demo's,
# and in the tests the permutation demo's server with the map, test_cli.py).
LAUNCHER_PRELOAD = (
    "sglang.srt.arg_groups.overrides",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
    "sglang.srt.utils",
    "sglang.srt.utils.common",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.models.registry",
)


def _is_late(name: str) -> bool:
    return any(name.startswith(v) if v.endswith("_") else name == v for v in LATE_VARIABLES)


class ForkedProcess:
    """A child of a zygote, seen as ``subprocess.Popen`` sees its child."""

    def __init__(self, pid: int, status_path: Path, zygote: subprocess.Popen):
        self.pid = pid
        self.returncode: int | None = None
        self._status_path = status_path
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._status_path.exists():
                self.returncode = int(self._status_path.read_text())
            elif self._zygote.poll() is not None and not _exists(self.pid):
                self.returncode = -1  # the zygote died first: init reaped the child, status unknown
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class Zygote:
    """Parent side of one zygote process."""

    def __init__(self, env: dict, preload: tuple[str, ...]):
        # Removed when this process exits (not at close(): a child may still have a status to read).
        self._tmp = tempfile.TemporaryDirectory(prefix="frspec-zygote-")
        self._dir = Path(self._tmp.name)
        self.log_path = self._dir / "zygote.log"
        # This module and the modules it forks (tests.* for the suite's ranks) are found from the
        # repository root.
        env = env | {"PYTHONPATH": pythonpath_with(env, REPO)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, *preload],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )  # it exits when its stdin closes: at close(), or when this process ends
        self._lock = threading.Lock()
        self._forks = 0

    def run_module(
        self,
        module: str,
        args: list[str],
        log: Path,
        late_env: dict,
        fork_children: bool = False,
        stderr_log: Path | None = None,
    ) -> ForkedProcess:
        """Fork ``python -m module *args``, appending its output to ``log`` (its stderr to
        ``stderr_log`` where given); ``late_env`` (only ``LATE_VARIABLES``) is added to the
        child's environment; ``fork_children``: see ``_fork_multiprocessing_children``."""
        with self._lock:
            self._forks += 1
            status = self._dir / f"status{self._forks}"
            request = {"module": module, "args": list(args), "log": str(log), "status": str(status),
                       "late_env": late_env, "fork_children": fork_children,
                       "stderr_log": str(stderr_log or log)}  # fmt: skip
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                reply = self.proc.stdout.readline()
            except BrokenPipeError:
                reply = ""
        if not reply:
            raise RuntimeError(f"the zygote exited; its log:\n{self.log_path.read_text()[-4000:]}")
        return ForkedProcess(int(reply), status, self.proc)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()
# Every zygote started, as (its first preload module, the variables and preloads that set its key
# apart from the previous zygote's): a suite that starts many (each ~20 s of imports) shows here.
ZYGOTES_STARTED: list[tuple[str, list[str]]] = []


def fork_module(
    env: dict,
    preload: tuple[str, ...],
    module: str,
    args: list[str],
    log: Path,
    fork_children: bool = False,
    stderr_log: Path | None = None,
) -> ForkedProcess:
    """``python -m module *args`` with ``env`` (less ``PER_TEST_VARIABLES``), forked from the
    zygote of that environment (less ``LATE_VARIABLES``) and ``preload``."""
    late = {k: v for k, v in env.items() if _is_late(k)}
    early = {k: v for k, v in env.items() if k not in late}
    return zygote_for(early, preload).run_module(module, args, log, late, fork_children, stderr_log)


def forked_launch(env: dict, args: list[str], log_path: Path) -> ForkedProcess:
    """An ``SGLangServer`` launch: the server's launcher forked from the zygote of ``env``, its
    schedulers forked from the launcher (``_fork_multiprocessing_children``)."""
    return fork_module(env, LAUNCHER_PRELOAD, LAUNCHER, args, log_path, fork_children=True)


def zygote_for(env: dict, preload: tuple[str, ...]) -> Zygote:
    """The live zygote started with ``env`` (less ``PER_TEST_VARIABLES``) and ``preload``; started
    now if there is none."""
    env = {k: v for k, v in env.items() if k not in PER_TEST_VARIABLES}
    key = (tuple(sorted(env.items())), preload)
    with _zygotes_lock:
        zygote = _zygotes.pop(key, None)
        if zygote is None or zygote.proc.poll() is not None:
            zygote = Zygote(env, preload)
            ZYGOTES_STARTED.append((preload[0] if preload else "-", _key_change(key)))
        _zygotes[key] = zygote  # most recently used last
        while len(_zygotes) > MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        return zygote


def close_zygotes(preload: tuple[str, ...]) -> None:
    """Close every live zygote of ``preload``: a test's throwaway zygotes, which would otherwise
    push the suite's SGLang zygotes out of the ``MAX_ZYGOTES`` kept (each ~20 s to start again)."""
    with _zygotes_lock:
        for key in [key for key in _zygotes if key[1] == preload]:
            _zygotes.pop(key).close()


_last_key: tuple = ((), ())


def _key_change(key: tuple) -> list[str]:
    """The variables (and the preload list) in which ``key`` differs from the last zygote's key."""
    global _last_key
    (env, preload), (last_env, last_preload) = key, _last_key
    _last_key = key
    if not last_env:
        return []
    changed = sorted(dict(set(env) ^ set(last_env)))
    return changed + (["<preload>"] if preload != last_preload else [])


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _serve(preload: list[str]) -> None:
    """Zygote main: import ``preload``, then fork one child per request line; record exit statuses."""
    for module in preload:
        importlib.import_module(module)
    status_paths: dict[int, str] = {}

    def reap(*_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = status_paths.pop(pid)
            Path(path + ".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)  # never seen half-written

    signal.signal(signal.SIGCHLD, reap)
    while line := sys.stdin.readline():
        request = json.loads(line)
        # No reaping between fork and recording the pid's status path.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            _run_child(request)  # never returns
        status_paths[pid] = request["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(pid, flush=True)


def _run_child(request: dict) -> None:
    """In the forked child: a session of its own, the log as stdout/stderr, then the module as
    ``__main__``. Its exit (return, ``sys.exit`` or an exception) is the interpreter's own."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    os.setsid()  # kill_tree ends the child's own process group
    for fd, path in ((1, request["log"]), (2, request["stderr_log"])):
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, fd)
        os.close(log)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.update(request["late_env"])  # absent from the zygote's environment: see LATE_VARIABLES
    _register_external_models(request["late_env"].get("SGLANG_EXTERNAL_MODEL_PACKAGE"))
    if request["fork_children"]:
        _fork_multiprocessing_children()
    sys.argv = [request["module"], *request["args"]]  # run_module sets argv[0] to the module's file
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def _register_external_models(package: str | None) -> None:
    """Add ``package``'s model classes to a model registry the zygote imported without them, as
    SGLang's import does when SGLANG_EXTERNAL_MODEL_PACKAGE is set (``import_model_classes``; the
    package's classes win over a default of the same name)."""
    registry = sys.modules.get("sglang.srt.models.registry")
    if package and registry is not None:
        registry.ModelRegistry.register(package, overwrite=True)


def _fork_multiprocessing_children() -> None:
    """Start ``multiprocessing`` children by fork, whatever start method the module then sets.

    SGLang sets spawn (sglang 0.5.23 entrypoints/engine.py, ``mp.set_start_method("spawn",
    force=True)``), so every scheduler and the detokenizer re-import torch and SGLang: about 30 s
    of this 2-core machine per server start, most of a server test. Forked, they begin with the
    launcher's imports and run the same code. What a fork inherits and a spawn would redo is the
    plugin's registration, done by ``load_plugins`` in the launcher (idempotent: the scheduler's
    own call finds it done); the real spawn path, with schedulers that load the plugin themselves,
    is what a new Python's launch runs (``SGLangServer``'s default: the demo's servers; in the
    tests, ``test_cli.py::test_demo_on_the_permutation_fixture``'s server with the map)."""
    multiprocessing.set_start_method("fork", force=True)
    multiprocessing.set_start_method = lambda method=None, force=False: None
    # GNU OpenMP (torch's CPU intra-op threads) is not fork-safe: a child forked after its parent ran
    # a parallel region on more than one thread waits forever, at its first parallel region, for the
    # parent's pool threads, which the child does not have. Seen: a Gemma 3 scheduler stuck in
    # libgomp under RotaryEmbedding's einsum at 'Load weight begin', after the launcher's plugin
    # checks had run a parallel op. So the launcher runs torch on one thread (no pool to inherit)
    # and each forked child gets the zygote's thread count back, as a spawned one would have it.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    os.register_at_fork(after_in_child=lambda: torch.set_num_threads(threads))


if __name__ == "__main__":
    _serve(sys.argv[1:])
