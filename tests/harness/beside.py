"""A few slow tests run by a second pytest *beside* the session's other server tests.

A TP=2 server test on the 2-core machine leaves about a quarter of its cores idle (HTTP and gloo
round trips, single-threaded imports, TP=1 schedulers); tests whose work is mostly new Pythons
and their own servers fill that time when they run at once with the others. ``BesideRun`` starts
``python -m pytest NODEIDS`` in a session of its own (its log and JUnit XML in ``folder``), and
``outcome`` waits for it and reads one test's result back. The tests are unchanged: the same
code, fixtures and assertions in another process, started when the session's first server test
starts (the unit tier leaves no idle core to fill)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from sglang_frspec.demo.server import kill_tree

# Set in the second pytest's environment: its conftest runs its tests itself and starts no builds.
CHILD_VARIABLE = "FRSPEC_TESTS_RUN_BESIDE"
REPO = Path(__file__).resolve().parents[2]


def nodeid_of(case: ElementTree.Element) -> str:
    """A JUnit ``testcase``'s pytest node id (module-level test functions: ``tests.test_x`` -> path)."""
    return f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"


class BesideRun:
    def __init__(self, nodeids: list[str], folder: Path, root: Path = REPO):
        self.nodeids = nodeids
        self.folder = folder
        self.root = root  # where the run starts (node ids are relative to it)
        self.log_path = folder / "pytest.log"
        self.junit_path = folder / "junit.xml"
        self.proc: subprocess.Popen | None = None
        self._cases: dict[str, ElementTree.Element] | None = None

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                   f"--basetemp={self.folder / 'tmp'}", f"--junitxml={self.junit_path}",
                   *self.nodeids]  # fmt: skip
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=self.root,
                env=os.environ | {CHILD_VARIABLE: "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # kill_tree ends it with its servers
            )

    def outcome(self, nodeid: str) -> tuple[str, str]:
        """``(passed|failed|skipped|missing, text)`` of one test, once the run has ended."""
        if self._cases is None:
            self.proc.wait()
            cases = []
            if self.junit_path.exists():
                cases = ElementTree.parse(self.junit_path).getroot().iter("testcase")
            self._cases = {nodeid_of(case): case for case in cases}
        case = self._cases.get(nodeid)
        if case is None:
            return "missing", self.log_tail()
        for tag, outcome in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                return outcome, found.get("message", "") if outcome == "skipped" else (found.text or "")
        return "passed", ""

    def seconds(self) -> dict[str, float]:
        """Each test's time in the run (setup, call and teardown), once it has ended."""
        return {nodeid: float(case.get("time", 0)) for nodeid, case in (self._cases or {}).items()}

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid, graceful=False)
