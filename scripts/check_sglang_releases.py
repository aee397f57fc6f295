#!/usr/bin/env python3
"""Check the contract with SGLang against the source of every release in the declared range.

Lists the releases with `pip index versions sglang`, keeps those pyproject.toml's `sglang`
requirement allows, downloads each wheel without its dependencies and reads its source with
`ast` (nothing is installed). Prints, per release, the torch it pins and the form it takes of each
seam where releases differ (adapters/hooks.py's VARIANTS), or each problem on a line of its own,
named by its SGLang target. Fails if a release breaks the contract, if none is found, or if pip
cannot reach the index. A README.md compatibility table that differs from the one generated here
(a new release that keeps the contract) is only warned about, so a release published upstream
cannot fail an unchanged project. `--table` only prints the table (to paste into README.md);
`--list` only the releases in range, newest first (scripts/test-releases reads it).

Run with the project's interpreter: `.venv/bin/python scripts/check_sglang_releases.py`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from sglang_frspec.adapters.contract import ReleaseCheck, choose_forms, compatibility_table, contract_problems
from sglang_frspec.adapters.contract_check import SourceSGLang

REPO = Path(__file__).resolve().parent.parent
TABLE_BEGIN, TABLE_END = "<!-- sglang-compat:begin -->", "<!-- sglang-compat:end -->"


def declared_requirement() -> Requirement:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (sglang,) = (r for r in map(Requirement, dependencies) if r.name == "sglang")
    return sglang


def pinned_version() -> str:
    """The SGLang version the tests run on (constraints.txt)."""
    match = re.search(r"^sglang==(\S+)", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    if match is None:
        sys.exit("constraints.txt pins no sglang==VERSION")
    return match.group(1)


def pip(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"pip {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def releases_in_range(requirement: Requirement) -> list[str]:
    listing = pip("index", "versions", "sglang")
    match = re.search(r"^Available versions: (.+)$", listing, re.MULTILINE)
    if match is None:
        sys.exit(f"pip index versions sglang printed no 'Available versions:' line:\n{listing}")
    versions = [v.strip() for v in match.group(1).split(",")]
    in_range = sorted((v for v in versions if requirement.specifier.contains(v)), key=Version, reverse=True)
    if not in_range:
        sys.exit(f"no SGLang release on the index matches {requirement} (found {versions[:5]} ...)")
    return in_range


def check_release(version: str, folder: Path) -> ReleaseCheck:
    """The release's torch pin, problems and forms, read from its wheel."""
    target = folder / version
    pip("download", "--quiet", "--no-deps", "--only-binary", ":all:", f"sglang=={version}", "-d", str(target))
    (wheel,) = target.glob("sglang-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        torch = re.search(
            r"^Requires-Dist: torch\s*==\s*([\w.]+)", archive.read(metadata).decode(), re.MULTILINE
        )
        source = SourceSGLang(archive, version)
        forms = {seam: form.name for seam, form in choose_forms(source)[0].items()}
        return ReleaseCheck(version, torch.group(1) if torch else "?", contract_problems(source), forms)


def release_test_runs(versions: list[str]) -> dict[str, str]:
    """Which tests run on which release: the whole suite on the pin, the every_release tests on the
    oldest release in range in scripts/test (so in CI) and on the others in scripts/test-releases."""
    pinned, oldest = pinned_version(), versions[-1]
    runs = {v: "every_release tests (`scripts/test-releases`)" for v in versions}
    runs[oldest] = "every_release tests (`scripts/test`, CI)"
    runs[pinned] = "whole suite (`scripts/test`, CI; constraints.txt)"
    return runs


def readme_table() -> str:
    text = (REPO / "README.md").read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        sys.exit(f"README.md lacks the {TABLE_BEGIN} ... {TABLE_END} markers around the table")
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the compatibility table only")
    parser.add_argument("--list", action="store_true", help="print the releases in range only, newest first")
    args = parser.parse_args()
    start = time.monotonic()
    requirement = declared_requirement()
    versions = releases_in_range(requirement)
    if args.list:
        print("\n".join(versions))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="sglang-releases-") as folder:
        for version in versions:
            release = check_release(version, Path(folder))
            results.append(release)
            if args.table:
                continue
            if release.problems:
                print(f"sglang {version} (torch {release.torch}) breaks the contract:", flush=True)
                print("\n".join(f"  {problem}" for problem in release.problems), flush=True)
            else:
                forms = ", ".join(f"{seam}={name}" for seam, name in release.forms.items())
                print(f"sglang {version} (torch {release.torch}): contract holds; forms: {forms}", flush=True)
    table = compatibility_table(results, release_test_runs(versions))
    if args.table:
        print(table)
        return 0
    broken = [r.version for r in results if r.problems]
    print(
        f"checked {len(versions)} release(s) in {requirement} in {time.monotonic() - start:.1f} s: {versions}"
    )
    if table != readme_table():
        print(
            f"warning: README.md's compatibility table is out of date; replace it with:\n{table}",
            file=sys.stderr,
        )
    if broken:
        print(f"releases in the declared range that break the contract: {broken}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
