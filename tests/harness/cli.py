"""The ``sglang-frspec`` command line as a user runs it (``python -m sglang_frspec ARGS``), forked
from a zygote that has imported the command line's modules (torch among them): each command then
starts in a fraction of a second instead of ~6 s of imports. Same code, argv, environment, exit
status, stdout and stderr as a new process (``tools/serving/zygote.py``)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from tests.harness.forked_python import wait_or_kill
from tools.serving.zygote import fork_module

CLI_PRELOAD = ("sglang_frspec.cli",)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m sglang_frspec *args`` run to its exit, as ``subprocess.run`` with captured text
    output would return it."""
    with tempfile.TemporaryDirectory(prefix="frspec-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = fork_module(dict(os.environ), CLI_PRELOAD, "sglang_frspec", list(args), out, stderr_log=err)
        status = wait_or_kill(child, timeout)
        return subprocess.CompletedProcess(["sglang-frspec", *args], status, out.read_text(), err.read_text())
