"""The GPU server kit (tools/gpu_kit/build.py, tools/gpu_kit/gpu_site/, gpu_server_check.*) stays runnable.

No GPU and no download here: SGLang's CUDA path is imported with CUDA faked, in a Python that
sees only what the device would (the installed packages the device has or the kit carries,
SGLang without the files the kit prunes, the kit's site), and the check plugin's Triton tree
kernels run in Triton's interpreter against the CPU stand-in's reference.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tools.gpu_kit import build as gpu_kit
from tools.gpu_kit import gpu_server_check

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / "tools" / "gpu_kit"
GPU_SITE = KIT / "gpu_site"

# The device's Python packages, as /work/.library/device/KINDS.md lists them (read 2026-11-17).
DEVICE_PACKAGES = [
    line for line in (GPU_SITE / "device_packages.txt").read_text().splitlines() if not line.startswith("#")
]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_pinned_dependencies_are_the_installed_versions():
    """The kit downloads exactly what `pip install sglang==0.5.23` installed here."""
    pinned = dict(req.split("==") for req in gpu_kit.DEPENDENCIES)
    installed = {name: importlib.metadata.version(name) for name in pinned}
    assert installed == pinned
    assert importlib.metadata.version("sglang") == gpu_kit.SGLANG_VERSION
    assert not {normalized(n) for n in pinned} & {normalized(n) for n in DEVICE_PACKAGES}, "the device has it"


def test_prune_rules_match_sglang_files():
    """Each pattern removes files of the installed SGLang, and only under the folders it names."""
    root = Path(importlib.util.find_spec("sglang").origin).parent.parent
    files = [p.relative_to(root).as_posix() for p in (root / "sglang").rglob("*") if p.is_file()]
    for pattern in gpu_kit.PRUNED:
        assert any(re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), f) for f in files), pattern
    pruned = [f for f in files if gpu_kit.is_pruned(f)]
    assert all(f.startswith("sglang/multimodal_gen/") or f.endswith(".so") for f in pruned)
    assert not [f for f in files if f.endswith(".so") and not gpu_kit.is_pruned(f)], "SGLang keeps a binary"


def fake_wheel(path: Path) -> Path:
    """A small wheel shaped like SGLang's: kept and pruned files, a RECORD, a platform tag."""
    with zipfile.ZipFile(path, "w") as wheel:
        for name in ("sglang/__init__.py", "sglang/srt/a,b.json", "sglang/multimodal_gen/x.py"):
            wheel.writestr(name, f"# {name}\n")
        wheel.writestr("sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
        wheel.writestr("sglang/srt/rust_extensions/loader.py", "# loader\n")
        wheel.writestr("sglang-0.5.23.dist-info/METADATA", "Name: sglang\nVersion: 0.5.23\n")
        wheel.writestr(
            "sglang-0.5.23.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-manylinux_2_34_x86_64\n\n",
        )
        wheel.writestr("sglang-0.5.23.dist-info/RECORD", "stale\n")
    return path


def test_prune_wheel_is_reproducible_pure_python_and_installable(tmp_path):
    src = fake_wheel(tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = gpu_kit.prune_wheel(src, tmp_path / "a"), gpu_kit.prune_wheel(src, tmp_path / "b")
    assert first.name == "sglang-0.5.23-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes()
    names = zipfile.ZipFile(first).namelist()
    assert sorted(names) == sorted(
        [
            "sglang/__init__.py",
            "sglang/srt/a,b.json",
            "sglang/srt/rust_extensions/loader.py",
            "sglang-0.5.23.dist-info/METADATA",
            "sglang-0.5.23.dist-info/WHEEL",
            "sglang-0.5.23.dist-info/RECORD",
        ]
    )
    # pip (offline) accepts it for the device's Python and checks RECORD against the files.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--python-version", "3.12", "--only-binary=:all:", "--target", str(target), str(first)],
        check=True,
        capture_output=True,
    )
    assert (target / "sglang" / "srt" / "a,b.json").is_file()
    assert not (target / "sglang" / "multimodal_gen").exists()


def test_plugin_metadata_declares_the_project_entry_points(tmp_path):
    dist_info = gpu_kit.write_plugin_metadata(tmp_path)
    found = importlib.metadata.PathDistribution(dist_info)
    assert found.version == importlib.metadata.version("sglang-frspec")
    assert {(ep.name, ep.value) for ep in found.entry_points} == {
        (ep.name, ep.value)
        for ep in importlib.metadata.distribution("sglang-frspec").entry_points
        if ep.group == "sglang.srt.plugins"
    }


def device_site(root: Path) -> Path:
    """site-packages as the device has it once the kit is installed: links to the installed
    packages the device has or the kit carries, and SGLang without the kit's pruned files."""
    site = Path(sysconfig.get_paths()["purelib"])
    allowed = {normalized(n) for n in DEVICE_PACKAGES} | {
        normalized(req.split("==")[0]) for req in (*gpu_kit.DEPENDENCIES, "sglang==")
    }
    providers = importlib.metadata.packages_distributions()
    root.mkdir()
    for entry in site.iterdir():
        top = entry.name.split(".")[0]
        if entry.name.endswith(".dist-info"):
            keep = normalized(importlib.metadata.PathDistribution(entry).name) in allowed
        elif entry.name.endswith(".libs"):  # shared libraries that wheels' extensions load
            keep = True
        else:
            keep = any(normalized(d) in allowed for d in providers.get(top, ()))
        if keep and top == "sglang" and entry.is_dir():
            link_pruned(entry, root / entry.name, "sglang")
        elif keep:
            (root / entry.name).symlink_to(entry)
    return root


def link_pruned(src: Path, dst: Path, rel: str) -> None:
    """Mirror ``src`` with links, leaving out what the kit prunes (``rel``: its path in the wheel)."""
    dst.mkdir()
    for entry in src.iterdir():
        path = f"{rel}/{entry.name}"
        inside = [p for p in entry.rglob("*") if p.is_file()] if entry.is_dir() else []
        kept = [p for p in inside if not gpu_kit.is_pruned(f"{path}/{p.relative_to(entry).as_posix()}")]
        if entry.is_dir() and len(kept) < len(inside):
            if kept:
                link_pruned(entry, dst / entry.name, path)
        elif not gpu_kit.is_pruned(path):
            (dst / entry.name).symlink_to(entry)


FAKE_CUDA = """
import sys
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "NVIDIA H200"
from tools.gpu_kit import gpu_server_check
gpu_server_check.import_cuda_path()
gpu_server_check.check_tree_kernels("cpu")
import importlib.util
import flash_mla
import sgl_kernel
print("sites:", sgl_kernel.__file__, flash_mla.__file__)
print("hidden:", [n for n in ("flashinfer", "vllm", "sgl_kernel_npu") if importlib.util.find_spec(n) is None])
"""


@pytest.mark.timeout(600)
def test_cuda_path_imports_with_the_kit_and_tree_kernels_match(tmp_path):
    """What the device's import smoke step runs, here with CUDA faked and the Triton interpreter."""
    site = device_site(tmp_path / "site")
    kit_site = tmp_path / "kit_site"
    gpu_kit.write_plugin_metadata(kit_site)
    path = [GPU_SITE, REPO, kit_site, site]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": ":".join(map(str, path)),
        "TRITON_INTERPRET": "1",
        **gpu_server_check.DEVICE_ENV,
    }
    # -S: no site-packages but the emulated one (PYTHONPATH); the repository is not installed there.
    proc = subprocess.run(
        [sys.executable, "-S", "-c", FAKE_CUDA], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"{len(gpu_server_check.CUDA_PATH_MODULES)} CUDA-path modules imported" in proc.stdout
    assert "equal the reference on 20 EAGLE trees (cpu;" in proc.stdout
    assert f"sites: {GPU_SITE}/sgl_kernel/__init__.py {GPU_SITE}/flash_mla/__init__.py" in proc.stdout
    assert "hidden: ['flashinfer', 'vllm', 'sgl_kernel_npu']" in proc.stdout


def dry_run_steps() -> dict[str, tuple[int, list[str]]]:
    """The check script's steps (name -> limit in seconds, command) as its --dry-run lists them."""
    script = KIT / "gpu_server_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    proc = subprocess.run(
        ["bash", str(script), "--dry-run"],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": "/nonexistent/out"},
        capture_output=True,
        text=True,
        check=True,
    )
    steps = {}
    for line in proc.stdout.splitlines():
        name, limit, command = re.fullmatch(r"step (\w+): limit (\d+)s: (.*)", line).groups()
        steps[name] = (int(limit), command.split())
    return steps


def test_check_script_steps_fit_nine_minutes_and_call_the_steps_it_defines():
    steps = dry_run_steps()
    assert list(steps) == ["machine", "install", "imports", "fixture", "graphs", "eager", "kernels"]
    required = sum(limit for name, (limit, _) in steps.items() if name != "kernels")
    assert required <= 540 and steps["kernels"][0] <= 540  # the kernel step gets what is left
    for name in ("imports", "fixture", "graphs", "eager"):
        command = steps[name][1]
        assert command[:3] == [sys.executable, "-m", "tools.gpu_kit.gpu_server_check"]
        assert gpu_server_check.parser().parse_args(command[3:]).step in (name, "serve")
    assert steps["install"][1][-1].startswith("gpu-kit/wheels/")


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_server_arguments_parse_in_this_sglang(mode):
    """Every flag and choice of the check's server exists in the installed SGLang's command line."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(gpu_server_check.server_args(Path("/fixture"), mode))
    assert (args.attention_backend, args.sampling_backend, args.grammar_backend) == (
        "triton",
        "pytorch",
        "none",
    )
    assert args.speculative_token_map == "/fixture/map_hot.pt"
    assert args.disable_cuda_graph == (mode == "eager")


def test_greedy_reference_follows_the_fixture_chain(perm):
    """The check's expected outputs come from the target's weights; on a chain they are the chain."""
    chain = list(perm.chain)
    got = gpu_server_check.greedy_reference(perm.target, [chain[:3], chain[40:45]], 24)
    assert got == [chain[3:27], chain[45:69]]
