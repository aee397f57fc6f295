"""Print pip's package sources and constraints as ``uv pip install`` arguments, one per line.

uv reads no pip configuration; ``scripts/setup`` passes these so uv installs from the same indexes,
find-links and constraint files that ``pip`` would use on this machine (``pip config list``: files
and ``PIP_*`` variables)."""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "-c"}  # fmt: skip


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings: dict[tuple[str, str], None] = {}  # (flag, value) in pip's order, each once
    for line in listing.splitlines():
        key, _, quoted = line.partition("=")
        flag = FLAGS.get(key.rsplit(".", 1)[-1])
        if flag and quoted:
            settings |= dict.fromkeys((flag, item) for item in shlex.split(quoted)[0].split())
    for flag, item in settings:
        print(flag, item, sep="\n")


if __name__ == "__main__":
    main()
