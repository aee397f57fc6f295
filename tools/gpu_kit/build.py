"""Build the GPU server kit: the wheels a lent H200 needs to run a real SGLang server with this plugin.

The device (see docs/benchmarks.md, "First GPU server check: the kit") has Python 3.12, torch
2.11 and triton, but no SGLang and no network; each call carries at most 64 MiB of files. This
script downloads, for CPython 3.12 on manylinux x86_64, SGLang 0.5.23 and the 32 dependencies
it needs at import time that the device lacks (at the versions SGLang 0.5.23 installs here,
pinned below), prunes the SGLang wheel to pure Python, writes this plugin's entry-point metadata
and checks the total against the carry limit. Output (ignored by git): ``gpu-kit/wheels/*.whl``
and ``gpu-kit/site/sglang_frspec-<version>.dist-info``. Needs the package index.

    .venv/bin/python -m tools.gpu_kit.build            # build (or rebuild) gpu-kit/
"""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "gpu-kit"
SGLANG_VERSION = "0.5.23"
CONSTRAINTS = REPO / "constraints.txt"
KIT_PINS = "# GPU kit:"  # the line in constraints.txt after which the kit's pins are listed


def kit_dependencies() -> tuple[str, ...]:
    """What `import sglang.launch_server` and the server's CUDA path need and the device lacks (its
    package list: /work/.library/device/KINDS.md): the pins after constraints.txt's GPU-kit line,
    which the tests' environment is installed with too (tests/test_gpu_kit.py checks them against
    the installed versions). Installed there with --no-deps: import-time needs, not SGLang's tree."""
    lines = CONSTRAINTS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(KIT_PINS))
    return tuple(pin for line in lines[start + 1 :] if (pin := line.split("#")[0].strip()))


DEPENDENCIES = kit_dependencies()
# pip matches each manylinux_2_N tag exactly, so every glibc level a wheel may be built for is
# listed; the device's glibc (Ubuntu 24.04's Python 3.12.3) is newer than all of them.
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64") + tuple(
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)
)
# Removed from the SGLang wheel (paths inside it, fnmatch patterns), with the reason for each.
PRUNED = (
    # The diffusion-model runtime (`sglang.multimodal_gen`): a separate server the check never starts.
    "sglang/multimodal_gen/*",
    # Rust extensions, 18 MB compressed: the Rust HTTP server (`_server`, off by default), gRPC
    # (`_grpc`, only with --grpc-port), the benchmark client and the multimodal processor. SGLang
    # imports each inside try/except or only when its feature is asked for.
    "sglang/srt/rust_extensions/*.so",
    # The Rust radix-tree core links the libtorch SGLang pins (2.14.1) and must not load under the
    # device's torch 2.11; SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python selects the Python core.
    "sglang/srt/mem_cache/rust_tree_core/*.so",
)
CARRY_LIMIT_MIB = 64.0  # everything one device call carries: the repository and named paths
KIT_LIMIT_MIB = 48.0  # the kit's share, leaving the rest for the repository itself
# Zip entry time of the files this script writes (the pruned wheel's RECORD and WHEEL): fixed,
# so the same downloaded wheel always prunes to the same bytes.
FIXED_DATE_TIME = (2020, 1, 1, 0, 0, 0)


def is_pruned(path: str) -> bool:
    """Whether a path inside the SGLang wheel (``sglang/...``) is left out of the kit."""
    return any(fnmatch.fnmatch(path, pattern) for pattern in PRUNED)


def _record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def prune_wheel(wheel: Path, out_dir: Path) -> Path:
    """Write ``wheel`` without the PRUNED files into ``out_dir``, retagged pure Python.

    What is left is pure Python, so the wheel is tagged ``py3-none-any``: pip then installs it
    on any glibc (the original is ``manylinux_2_34``). RECORD lists what remains. Entries are
    copied in the original order with their original times, so the output is reproducible.
    """
    name, version = wheel.name.split("-")[:2]
    dist_info = f"{name}-{version}.dist-info"
    out = out_dir / f"{name}-{version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if is_pruned(info.filename) or info.filename in (f"{dist_info}/RECORD", f"{dist_info}/WHEEL"):
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            records.append(_record_row(info.filename, data))
        if f"{dist_info}/WHEEL" not in src.namelist():
            raise ValueError(f"{wheel.name}: no {dist_info}/WHEEL, not a wheel of {name} {version}")
        wheel_meta = [
            line
            for line in src.read(f"{dist_info}/WHEEL").decode().splitlines()
            if line.strip() and not line.startswith(("Tag:", "Root-Is-Purelib:"))
        ]
        wheel_meta += ["Root-Is-Purelib: true", "Tag: py3-none-any"]
        wheel_data = ("\n".join(wheel_meta) + "\n").encode()
        dst.writestr(zipfile.ZipInfo(f"{dist_info}/WHEEL", FIXED_DATE_TIME), wheel_data)
        records += [_record_row(f"{dist_info}/WHEEL", wheel_data), [f"{dist_info}/RECORD", "", ""]]
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(records)  # quotes the names holding commas
        record_info = zipfile.ZipInfo(f"{dist_info}/RECORD", FIXED_DATE_TIME)
        dst.writestr(record_info, record.getvalue().encode(), compress_type=zipfile.ZIP_DEFLATED)
    return out


def write_plugin_metadata(site: Path) -> Path:
    """A dist-info for this repository that declares its SGLang plugin entry points (from pyproject.toml).

    On the device the repository is on PYTHONPATH, not pip-installed, so nothing else tells
    SGLang's plugin loader (``importlib.metadata`` entry points) that ``frspec`` exists.
    """
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["sglang.srt.plugins"]
    from sglang_frspec import __version__

    dist_info = site / f"sglang_frspec-{__version__}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {__version__}\n"
        "Summary: entry points of the repository on PYTHONPATH (GPU server check kit)\n"
    )
    lines = ["[sglang.srt.plugins]", *(f"{name} = {target}" for name, target in plugins.items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dist_info


def download(requirements: list[str], dest: Path) -> None:
    """``pip download`` these exact wheels for CPython 3.12 on manylinux x86_64, no dependencies."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest)]
    subprocess.run([*cmd, *requirements], check=True)


def mib(paths: list[Path]) -> float:
    return sum(p.stat().st_size for p in paths) / 2**20


def build(kit: Path) -> None:
    """Download, prune and write the kit into ``kit`` (replacing an earlier one); check its size."""
    if kit.exists():
        shutil.rmtree(kit)
    wheels = kit / "wheels"
    wheels.mkdir(parents=True)
    download(list(DEPENDENCIES), wheels)
    with tempfile.TemporaryDirectory() as tmp:
        download([f"sglang=={SGLANG_VERSION}"], Path(tmp))
        (original,) = Path(tmp).glob("sglang-*.whl")
        pruned = prune_wheel(original, wheels)
        print(f"sglang: {original.name} {mib([original]):.1f} MiB -> {pruned.name} {mib([pruned]):.1f} MiB")
    dist_info = write_plugin_metadata(kit / "site")
    files = [p for p in kit.rglob("*") if p.is_file()]
    found = sorted(p.name for p in wheels.glob("*.whl"))
    if len(found) != len(DEPENDENCIES) + 1:
        raise SystemExit(f"expected {len(DEPENDENCIES) + 1} wheels in {wheels}, found {len(found)}: {found}")
    total = mib(files)
    print(f"kit: {kit} holds {len(found)} wheels and {dist_info.name}: {total:.1f} MiB")
    if total > KIT_LIMIT_MIB:
        raise SystemExit(
            f"the kit is {total:.1f} MiB, over its {KIT_LIMIT_MIB:.0f} MiB share of the "
            f"{CARRY_LIMIT_MIB:.0f} MiB a device call carries: prune more"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", type=Path, default=KIT, help="output folder (default: gpu-kit/)")
    build(parser.parse_args().kit)


if __name__ == "__main__":
    main()
