"""The layers are a checked rule: what each part of the package may import (read with ast)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sglang_frspec"
# Imports each layer may not make (prefixes of absolute module names), besides the repository's
# tests (the harness included), benchmarks and tools, which no module of the package may import.
FORBIDDEN = {
    # The pure core: torch and the standard library (and, on CUDA, its kernel); never SGLang nor
    # anything above it.
    "core": ("sglang", "triton", "sglang_frspec.adapters", "sglang_frspec.maps", "sglang_frspec.cli",
             "sglang_frspec.demo", "sglang_frspec.plugin"),
    # Kernels: torch and triton only.
    "kernels": ("sglang", "sglang_frspec.core", "sglang_frspec.adapters", "sglang_frspec.maps",
                "sglang_frspec.cli", "sglang_frspec.demo", "sglang_frspec.plugin"),
    # Map tooling works without SGLang and below the CLI.
    "maps": ("sglang", "sglang_frspec.adapters", "sglang_frspec.cli", "sglang_frspec.demo",
             "sglang_frspec.plugin"),
    # The serving adapters never reach the CLI or the demo.
    "adapters": ("sglang_frspec.cli", "sglang_frspec.demo", "sglang_frspec.plugin"),
    # The demo starts servers as a user would: through SGLang's launcher, not the plugin's insides.
    "demo": ("sglang_frspec.adapters", "sglang_frspec.cli", "sglang_frspec.plugin"),
    "cli": (),
}  # fmt: skip
NEVER_IMPORTED = ("tests", "benchmarks", "tools")


def _imports(path: Path, root: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a module below ``root``, nested ones included."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            found += [(node.lineno, module)]
            if module == "sglang_frspec":  # the package's face: name each imported name
                found += [(node.lineno, f"sglang_frspec.{alias.name}") for alias in node.names]
    return found


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_imports_only_what_is_below_it(layer):
    assert _modules(layer)
    broken = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in _modules(layer)
        for line, module in _imports(path)
        if any(module == f or module.startswith(f"{f}.") for f in FORBIDDEN[layer] + NEVER_IMPORTED)
    ]
    assert broken == []


# The repository's tools and the package: tests import them, never the other way round.
TOOL_TREES = ("benchmarks", "scripts", "tools", "sglang_frspec")


def _imports_of_tests(root: Path) -> list[str]:
    """``path:line imports module`` for every import of ``tests`` (or a module of it) in a ``*.py``
    file under ``root``'s ``TOOL_TREES`` (scripts/ also holds bash scripts, which are not read)."""
    return [
        f"{path.relative_to(root)}:{line} imports {module}"
        for tree in TOOL_TREES
        for path in sorted((root / tree).rglob("*.py"))
        for line, module in _imports(path, root)
        if module == "tests" or module.startswith("tests.")
    ]


def test_tools_never_import_tests():
    """No benchmark, script, tool (``tools/``: the draft trainer, the zygote, greedy references,
    the trained fixture) or package module imports the tests or their harness."""
    root = PACKAGE.parent
    assert all(any((root / tree).rglob("*.py")) for tree in TOOL_TREES)
    assert _imports_of_tests(root) == []


def test_the_tests_rule_reads_nested_and_aliased_imports(tmp_path):
    """The checker itself: an import of the tests inside a function, an aliased one and a name
    taken from the ``tests`` package are found; a bash script and ``tests_util`` are not."""
    for tree in TOOL_TREES:
        (tmp_path / tree).mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(
        "import tests_util\n\n\ndef serve():\n    from tests.conftest import fixture_server\n"
    )
    (tmp_path / "benchmarks" / "probe.py").write_text(
        "import tests.harness.zygote as z\nfrom tests import harness\n"
    )
    (tmp_path / "scripts" / "probe").write_text("#!/usr/bin/env bash\nfrom tests import harness\n")
    assert _imports_of_tests(tmp_path) == [
        "benchmarks/probe.py:1 imports tests.harness.zygote",
        "benchmarks/probe.py:2 imports tests",
        "scripts/probe.py:5 imports tests.conftest",
    ]


def test_no_module_imports_the_package_face():
    """``sglang_frspec/__init__`` is for users; inside the package every import names its module."""
    broken = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "__init__.py"
        for line, module in _imports(path)
        if module == "sglang_frspec"
    ]
    assert broken == []


def test_the_rule_reads_relative_nested_and_face_imports(tmp_path):
    """The checker itself, on a module written here: a relative import inside a function and a
    name taken from the package's face are both found, as absolute modules."""
    module = tmp_path / "sglang_frspec" / "core" / "probe.py"
    module.parent.mkdir(parents=True)
    lines = [
        "import torch",
        "",
        "",
        "def f():",
        "    from ..adapters import worker",
        "    from sglang_frspec import kernels",
    ]
    module.write_text("\n".join(lines) + "\n")
    assert _imports(module, tmp_path) == [
        (1, "torch"),
        (5, "sglang_frspec.adapters"),
        (6, "sglang_frspec"),
        (6, "sglang_frspec.kernels"),
    ]
