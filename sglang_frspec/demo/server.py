"""Start real SGLang servers (``python -m sglang.launch_server``) and stop their whole tree."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

# SGLang's warmup thread logs this last. With --skip-server-warmup it still POSTs /freeze_gc (a
# 10 s read timeout) after /health turns 200; waiting for this line keeps test requests from
# overlapping it on a loaded machine (sglang 0.5.23 http_server._wait_and_warmup).
READY_LINE = "The server is fired up and ready to roll!"
# Every plugin server logs this once (rank 0) when its hot head is installed.
ACTIVE_LINE = re.compile(r"sglang-frspec: (\d+) hot ids over (\d+) rank\(s\), layout=(\w+) exchange=(\w+)")


class ServerError(RuntimeError):
    """A server that exited, or did not become ready; the message ends with its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    """The log's last ``lines``, preceded by its first error lines (a long warning traceback at
    the end must not hide the error that ended the server)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in text[:-lines] if re.search(r"Error|Exception|exit|[Kk]illed", line)][:20]
    head = ["(first error lines)", *errors, "(last lines)"] if errors else []
    return "\n".join(head + text[-lines:])


def plugin_activity(log: str) -> list[tuple[int, int, str, str]]:
    """(hot ids, ranks, layout, exchange) of each ``sglang-frspec: N hot ids over ...`` line."""
    return [(int(n), int(tp), layout, exchange) for n, tp, layout, exchange in ACTIVE_LINE.findall(log)]


def _process_tree(pid: int) -> list:
    """``pid``, its descendants and every other member of its process group (children of a
    launcher that already exited are reparented, but stay in the group it leads)."""
    import psutil

    procs = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        procs[pid] = root
        for child in root.children(recursive=True):
            procs[child.pid] = child
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if proc.pid not in procs and os.getpgid(proc.pid) == pid:
                procs[proc.pid] = proc
    return list(procs.values())


def kill_tree(pid: int, grace: float = 10.0, *, graceful: bool = True) -> None:
    """SIGTERM the process group and every descendant of ``pid``, then SIGKILL leftovers
    (``graceful=False``: SIGKILL at once).

    Safe to call on a process that already exited (its group's leftovers are still found)."""
    import psutil

    procs = _process_tree(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL) if graceful else (signal.SIGKILL,):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # started with start_new_session: pgid == pid
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        if not alive:
            return
        procs = alive


LAUNCHER = "sglang.launch_server"


class Process(Protocol):
    """What a server needs of its launcher's process (``subprocess.Popen`` has it)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# launch(env, args, log_path) runs ``python -m sglang.launch_server *args`` with ``env``, its
# output appended to ``log_path``, in a session of its own (``stop`` kills that process group).
Launch = Callable[[dict, list[str], Path], Process]


def new_python(env: dict, args: list[str], log_path: Path) -> subprocess.Popen:
    """The launcher in a new Python."""
    with open(log_path, "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", LAUNCHER, *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit`` in this process, so ``with SGLangServer`` blocks stop
    their servers on the way out.

    By default SIGTERM (``timeout``, a job scheduler, ``kill``) ends Python without running
    ``__exit__`` or ``finally``, and the server trees, each in a session of its own, keep a core
    busy each. Only from the main thread (where Python runs handlers) and only where SIGTERM still
    has its default action: a handler the program set itself is kept."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class SGLangServer:
    """One ``sglang.launch_server`` process tree on a free loopback port.

    Use as a context manager; ``log_path`` keeps the server's stdout and stderr. ``launch``
    starts the launcher process (a new Python by default; the tests fork it from a Python that
    has already imported SGLang). Starting one makes SIGTERM stop it too (``exit_on_sigterm``).
    """

    def __init__(
        self,
        args: list[str],
        env: dict,
        log_path: str | Path,
        ready_timeout: float = 420.0,
        *,
        launch: Launch = new_python,
    ):
        self.args = list(args)
        self.env = env
        self.launch = launch
        self.log_path = Path(log_path)
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.proc: Process | None = None
        self.started_at: float | None = None
        self.ready_after: float | None = None  # seconds from start() to ready, once ready
        level = args[args.index("--log-level") + 1] if "--log-level" in args else "info"
        self.logs_ready_line = level.lower() in ("debug", "info")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SGLangServer:
        args = [*self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text(f"$ ({self.launch.__name__}) python -m {LAUNCHER} {' '.join(args)}\n")
        self.started_at = time.monotonic()
        exit_on_sigterm()
        self.proc = self.launch(self.env, args, self.log_path)
        return self

    def wait_ready(self) -> SGLangServer:
        deadline = time.monotonic() + self.ready_timeout
        port_retries = 3
        healthy = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The port was free when picked, but SGLang's own processes also bind random
                # ports and may take it first: pick another one and start again. (The whole log:
                # uvicorn's bind error can sit mid-log, above a warm-up thread's traceback.)
                if port_retries and "address already in use" in self.log():
                    port_retries -= 1
                    self.stop()
                    self.port = free_port()
                    self.start()
                    healthy = False
                    continue
                raise ServerError(
                    f"server exited with status {self.proc.returncode} before it "
                    f"was ready; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if not healthy:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        healthy = r.status == 200
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
            if healthy and (not self.logs_ready_line or READY_LINE in self.log()):
                self.ready_after = time.monotonic() - self.started_at
                return self
            time.sleep(0.25)
        raise ServerError(
            f"server not ready after {self.ready_timeout:.0f}s; "
            f"log {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> int:
        """Wait for a server that is expected to fail; returns its exit status."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ServerError(
                f"server still running after {timeout:.0f}s; log {self.log_path}:\n{log_tail(self.log_path)}"
            ) from e

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise ServerError(
                f"POST {path} -> HTTP {e.code}: {e.read()[:2000]!r}; log "
                f"{self.log_path}:\n{log_tail(self.log_path)}"
            ) from e

    def get(self, path: str, timeout: float = 30.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.load(r)

    def generate(
        self, input_ids: list[int] | list[list[int]], max_new_tokens: int, **sampling
    ) -> dict | list[dict]:
        """Greedy by default; returns SGLang's /generate response (output_ids, meta_info)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0} | sampling
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": params})

    def _signal_tree(self, sig: signal.Signals) -> None:
        import psutil

        for proc in _process_tree(self.proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)

    def suspend(self) -> None:
        """SIGSTOP the whole tree: idle SGLang schedulers poll and would steal CPU from a
        server being measured next to it."""
        self._signal_tree(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_tree(signal.SIGCONT)

    def stop(self) -> None:
        """Kill the whole tree; also when the launcher already exited and left schedulers behind.

        SIGKILL, not SIGTERM: SGLang's launcher answers a scheduler ended by SIGTERM with a 5 s
        crash-diagnostics sleep, and its graceful drain takes as long (a test of the graceful
        path sends SIGTERM to the launcher itself)."""
        if self.proc is None:
            return
        kill_tree(self.proc.pid, graceful=False)  # SIGKILL also ends a suspended (SIGSTOP) process
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def __enter__(self) -> SGLangServer:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
