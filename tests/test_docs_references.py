"""The README's and docs' cross-references hold: every repository path and test name they cite exists.

A path is one under the repository's top folders (``sglang_frspec/``, ``tests/``, ``scripts/``,
``benchmarks/``, ``tools/``, ``docs/``); a ``path:N`` or ``path:N-M`` citation needs a file of at
least that many lines; ``{a,b}`` expands and ``*`` globs. A test name (``test_...``) must be a test
module's stem or a function or class defined somewhere under ``tests/``, and in the file it follows
(``tests/test_x.py::test_y``) when one is named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_FOLDERS = ("sglang_frspec", "tests", "scripts", "benchmarks", "tools", "docs")
# Not after a word character or a slash or a dot: SGLang's own paths (`srt/managers/...`) and
# module names (`sglang.srt.tools...`) are not this repository's.
PATH = re.compile(
    rf"(?<![\w/.-])((?:{'|'.join(TOP_FOLDERS)})/[\w./*-]*(?:\{{[\w.,-]+\}}[\w./-]*)?)"
    r"(?::(\d+)(?:-(\d+))?)?"
)
TEST_NAME = re.compile(r"(?<![\w/.-])(test_\w+)")
TEST_IN_FILE = re.compile(r"((?:tests/)?test_\w+\.py)::(\w+)")


def cited_paths(text: str) -> list[tuple[str, int]]:
    """(path, last line cited or 0) for each repository path in ``text``."""
    found = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        last_line = int(match.group(3) or match.group(2) or 0)
        braces = re.search(r"\{([\w.,-]+)\}", path)
        if braces:
            for choice in braces.group(1).split(","):
                found.append((path[: braces.start()] + choice + path[braces.end() :], last_line))
        else:
            found.append((path, last_line))
    return found


def path_problem(path: str, last_line: int) -> str | None:
    """Why ``path`` (``last_line`` > 0: cited at that line) does not hold, or None."""
    matches = sorted(REPO.glob(path.rstrip("/"))) if "*" in path else [REPO / path.rstrip("/")]
    existing = [m for m in matches if m.exists()]
    if not existing:
        return f"{path}: no such file or folder"
    if last_line:
        (target,) = existing
        if not target.is_file():
            return f"{path}:{last_line}: not a file"
        lines = len(target.read_text().splitlines())
        if lines < last_line:
            return f"{path}:{last_line}: the file has {lines} lines"
    return None


def names_defined_in(source: Path) -> set[str]:
    """Every function and class name defined in a Python file."""
    tree = ast.parse(source.read_text())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.walk(tree) if isinstance(node, kinds)}


def defined_test_names() -> set[str]:
    """Test modules' stems and every function and class name defined under tests/."""
    names = set()
    for source in (REPO / "tests").rglob("*.py"):
        names |= {source.stem} | names_defined_in(source)
    return names


def misplaced_tests(text: str) -> list[str]:
    """``file::name`` citations whose file exists but defines no such name."""
    problems = []
    for file, name in TEST_IN_FILE.findall(text):
        source = REPO / (file if file.startswith("tests/") else f"tests/{file}")
        if source.is_file() and name not in names_defined_in(source):
            problems.append(f"{file}::{name}")
    return problems


def test_the_reference_reader_finds_what_docs_cite():
    text = (
        "see `sglang_frspec/plugin.py:12`, docs/results/a-cpu.{txt,json}, tests/test_cpu_standin*.py, "
        "`srt/tools/x.py`, sglang.srt.tests/y, tests/harness/gpu_defaults/ and test_maps.py::test_x[a-1]."
    )
    assert cited_paths(text) == [
        ("sglang_frspec/plugin.py", 12),
        ("docs/results/a-cpu.txt", 0),
        ("docs/results/a-cpu.json", 0),
        ("tests/test_cpu_standin*.py", 0),
        ("tests/harness/gpu_defaults/", 0),
    ]
    assert TEST_NAME.findall(text) == ["test_maps", "test_x"]
    assert misplaced_tests(text) == ["test_maps.py::test_x"]
    assert misplaced_tests("tests/test_maps.py::test_api_is_deterministic_and_workers_agree") == []
    assert path_problem("sglang_frspec/plugin.py", 10**6).endswith("lines")
    assert path_problem("tests/test_no_such_module.py", 0).endswith("no such file or folder")
    assert path_problem("tests/test_cpu_standin*.py", 0) is None


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_cited_path_exists(doc):
    cited = cited_paths(doc.read_text())
    problems = {problem for path, line in cited if (problem := path_problem(path, line))}
    assert not problems, f"{doc.name} cites what does not exist:\n" + "\n".join(sorted(problems))


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_every_cited_test_name_exists(doc):
    defined = defined_test_names()
    text = doc.read_text()
    missing = sorted(set(TEST_NAME.findall(text)) - defined)
    assert not missing, f"{doc.name} cites test names defined nowhere under tests/: {missing}"
    misplaced = misplaced_tests(text)
    assert not misplaced, f"{doc.name} cites tests in files that do not define them: {misplaced}"
