"""``python -c CODE ARGS...`` in a child forked from the zygote that has imported SGLang
(``tools/serving/zygote.py``): the same code, argv and environment, without the ~30 s of a fresh
SGLang import. SGLang has been imported but no plugin loaded, as in a launcher before
``load_plugins``; SGLang's import has already given the root logger a handler, so code that sets
up logging passes ``force=True`` to ``logging.basicConfig``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sglang_frspec.demo.server import kill_tree
from tools.serving.zygote import LAUNCHER_PRELOAD, ForkedProcess, fork_module


def wait_or_kill(child: ForkedProcess, timeout: float) -> int:
    """The child's exit status; past ``timeout`` its session (the child and whatever it started)
    is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    try:
        return child.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(child.pid, grace=5.0)
        raise


def run_python(code: str, args: list[str], env: dict, log: Path, timeout: float = 600.0) -> tuple[int, str]:
    """Exit status and output (stdout and stderr together, as written to ``log``) of ``code``."""
    status = wait_or_kill(fork_module(env, LAUNCHER_PRELOAD, __name__, [code, *args], log), timeout)
    return status, log.read_text(errors="replace")


if __name__ == "__main__":
    code = sys.argv[1]
    sys.argv = ["-c", *sys.argv[2:]]  # as python -c sets it
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
