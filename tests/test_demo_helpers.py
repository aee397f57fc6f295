"""The demo package's helpers that the tests and benchmarks share: ``SGLangServer`` stops its
process tree however its owner ends, SIGTERM included; ``cached_build`` builds a fixture once
when several processes ask for it at the same time."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

# A stand-in launcher: answers /health with 200 on the port it is given, until killed. What is
# under test is the owner's exit path, not SGLang.
HEALTH_SERVER = """
import http.server, sys
class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Healthy).serve_forever()
"""

# A runner as the benchmarks are: one server in a ``with`` block, busy until it is killed.
RUNNER = """
import subprocess, sys, time
from sglang_frspec.demo.server import SGLangServer

def launch(env, args, log_path):
    port = args[args.index("--port") + 1]
    return subprocess.Popen([sys.executable, "-c", sys.argv[1], port], start_new_session=True)

with SGLangServer(["--log-level", "warning"], {}, sys.argv[2], launch=launch) as server:
    print(server.proc.pid, flush=True)
    time.sleep(600)
"""


def test_a_runner_ended_by_sigterm_stops_its_server(tmp_path):
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, HEALTH_SERVER, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = None
    try:
        server_pid = int(runner.stdout.readline())
        assert psutil.pid_exists(server_pid)
        runner.send_signal(signal.SIGTERM)
        status = runner.wait(timeout=60)
        server = psutil.Process(server_pid) if psutil.pid_exists(server_pid) else None
        alive = server is not None and server.status() != psutil.STATUS_ZOMBIE
        assert not alive, f"the server outlived its runner's SIGTERM (runner status {status})"
        assert status == 128 + signal.SIGTERM  # SystemExit's status, as exit_on_sigterm sets it
    finally:
        runner.kill()
        if server_pid is not None and psutil.pid_exists(server_pid):
            psutil.Process(server_pid).kill()


# Builds the fixture folder argv[1] with cached_build: each build is recorded in argv[2] and waits
# for the file argv[3] before it finishes.
CACHED_BUILDER = """
import sys, time
from pathlib import Path
from sglang_frspec.demo.fixtures import cached_build

def build(path):
    with open(sys.argv[2], "a") as builds:
        builds.write("build\\n")
    while not Path(sys.argv[3]).exists():
        time.sleep(0.05)
    path.mkdir()
    (path / "done").write_text("")

print("asking", flush=True)
cached_build(Path(sys.argv[1]), build, marker="done")
"""


def test_concurrent_cached_builds_of_one_fixture_build_it_once(tmp_path):
    root, builds, release = tmp_path / "cache" / "fixture", tmp_path / "builds.txt", tmp_path / "release"
    args = [sys.executable, "-c", CACHED_BUILDER, str(root), str(builds), str(release)]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    second = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == second.stdout.readline() == "asking\n"
        time.sleep(1.0)  # both are in cached_build now: one builds, the other waits (or builds too)
        release.touch()
        assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
        assert builds.read_text().splitlines() == ["build"]
        assert (root / "done").exists()
    finally:
        first.kill()
        second.kill()
