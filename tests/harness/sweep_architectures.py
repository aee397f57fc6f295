"""Serve every tiny architecture of ``architectures.py`` at TP=2 on CPU: plain greedy, then EAGLE
(or NEXTN) + token map + this plugin; outputs compared tie-aware, accept length and the
plugin's line recorded, or the error that stopped a server. The hybrid gated-delta-net MTP
families of ``qwen3_5_cpu.py`` (Qwen3.5, Qwen3-Next, each also as a ModelOpt checkpoint) are
swept the same way with their own server settings (NEXTN topk 1 with their MTP layer).

    .venv/bin/python -m tests.harness.sweep_architectures --out docs/results/architecture-sweep-cpu
    .venv/bin/python -m tests.harness.sweep_architectures --only gemma3_softcap qwen2
    .venv/bin/python -m tests.harness.sweep_architectures --report docs/results/architecture-sweep-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import shown_path
from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.server import ServerError, SGLangServer, plugin_activity
from tests.harness.architectures import ARCHITECTURES, architecture_fixture
from tests.harness.qwen3_5_cpu import SERVER_ARGS as HYBRID_ARGS
from tests.harness.qwen3_5_cpu import SERVER_ENV as HYBRID_ENV
from tests.harness.qwen3_5_cpu import modelopt_target, nextn_args, qwen3_5_target, qwen3_next_target
from tools.serving.greedy import compare_greedy, reference_greedy
from tools.serving.zygote import forked_launch

TP = 2
NEW_TOKENS = 24
PROMPTS = [[5, 77, 1203], [4000, 17], [9, 9, 9, 9, 2500]]
_ERROR_LINE = re.compile(r"^\s*(?:\w+\.)*\w*(?:Error|Exception|NotImplemented\w*)\b.*$", re.M)


@dataclass(frozen=True)
class Hybrid:
    """A hybrid gated-delta-net MTP family of ``qwen3_5_cpu.py``."""

    target_class: str
    build: Callable[[], str]  # builds (cached) the checkpoint; its folder
    modelopt: str | None = None  # served as this ModelOpt checkpoint (qwen3_5_cpu.MODELOPT_CONFIGS)


HYBRIDS = {
    "qwen3_5_mtp": Hybrid("Qwen3_5ForConditionalGeneration", qwen3_5_target),
    "qwen3_next_mtp": Hybrid("Qwen3NextForCausalLM", qwen3_next_target),
    "qwen3_5_mtp_modelopt_nvfp4": Hybrid("Qwen3_5ForConditionalGeneration", qwen3_5_target, "nvfp4"),
    "qwen3_next_mtp_modelopt_fp8": Hybrid("Qwen3NextForCausalLM", qwen3_next_target, "fp8"),
}
SWEPT = [*ARCHITECTURES, *HYBRIDS]


@dataclass(frozen=True)
class Case:
    """What one row serves: the target, arguments and environment of both servers, the draft's."""

    target: str
    extra_args: tuple[str, ...]
    speculative: list[str]
    env: dict[str, str]


def architecture_case(name: str) -> Case:
    arch = ARCHITECTURES[name]
    fixture = architecture_fixture(name)
    speculative = eagle_args(fixture.draft, fixture.token_map("hot"), algorithm=arch.algorithm)
    return Case(fixture.target, arch.extra_args, speculative, {})


def hybrid_case(name: str) -> Case:
    hybrid = HYBRIDS[name]
    target, extra = hybrid.build(), tuple(HYBRID_ARGS)
    if hybrid.modelopt:
        target = modelopt_target(target, hybrid.modelopt)
        extra += ("--dtype", "bfloat16")  # ModelOpt's configs accept bfloat16 and float16 only
    return Case(target, extra, nextn_args(target, topk=1, with_map=True), HYBRID_ENV)


def serve(case: Case, log_path: Path, speculative: bool) -> SGLangServer:
    """A CPU TP=2 server of the case's target; ``speculative`` adds the draft (and map)."""
    args = ["--model-path", case.target, "--tp-size", str(TP), *CPU_SERVER_ARGS, *case.extra_args]
    args += case.speculative if speculative else []
    return SGLangServer(args, cpu_env(TP) | case.env, log_path, launch=forked_launch)


# SGLang's warm-up thread logs these when it polls a server that is not listening yet: not the failure.
_NOISE = ("Warning", "Connection refused", "MaxRetryError", "NewConnectionError")


def first_error(log: str) -> str:
    """The first exception line of a server log (the one that ended it), else its last line."""
    lines = [line for line in _ERROR_LINE.findall(log) if not any(n in line for n in _NOISE)]
    return (lines[0] if lines else log.strip().splitlines()[-1]).strip()[:400]


def run_server(case: Case, log_path: Path, speculative: bool) -> dict:
    """Outputs and accept lengths of one server, or the error that stopped it."""
    start = time.monotonic()
    server = serve(case, log_path, speculative)
    try:
        with server:
            outs = server.generate(PROMPTS, NEW_TOKENS)
            log = server.log()
    except (ServerError, OSError):  # OSError: the server died mid-request (connection reset)
        return {"error": first_error(log_path.read_text(errors="replace")), "log": shown_path(log_path),
                "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    return {
        "output_ids": [o["output_ids"] for o in outs],
        "accept_lengths": [o["meta_info"].get("spec_accept_length") for o in outs],
        "plugin": plugin_activity(log),
        "seconds": round(time.monotonic() - start, 1),
        "log": shown_path(log_path),
    }


def agrees_with_hf(target: str, outputs: list[list[int]]) -> str:
    """Whether SGLang's plain greedy outputs equal HF's, up to near-ties (else the first difference)."""
    try:
        hf = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
        ties = compare_greedy(target, PROMPTS, outputs, hf)
    except AssertionError as e:
        return f"no: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - HF lacking this architecture is a result, not the end
        return f"not checked: {type(e).__name__}: {str(e)[:200]}"
    return f"yes ({len(ties)} near-tie(s))" if ties else "yes"


def sweep_one(name: str, log_dir: Path) -> dict:
    """Plain greedy and the speculative server for architecture ``name``, compared."""
    if name in HYBRIDS:
        hybrid = HYBRIDS[name]
        row = {"name": name, "target": hybrid.target_class, "algorithm": "NEXTN", "draft": "its MTP layer",
               "head": "own ParallelLMHead; the MTP draft's lm_head takes the target's"}  # fmt: skip
    else:
        arch = ARCHITECTURES[name]
        row = {"name": name, "target": arch.config["architectures"][0], "head": arch.head,
               "draft": arch.draft, "algorithm": arch.algorithm}  # fmt: skip
    try:
        case = hybrid_case(name) if name in HYBRIDS else architecture_case(name)
    except Exception as e:  # noqa: BLE001 - a builder failing is a result of the sweep, not its end
        return row | {"status": "build failed", "error": f"{type(e).__name__}: {e}"[:400]}
    plain = run_server(case, log_dir / f"{name}-plain.log", speculative=False)
    row["plain"] = plain
    if "error" in plain:
        return row | {"status": "plain server failed", "error": plain["error"]}
    row["plain_equals_hf"] = agrees_with_hf(case.target, plain["output_ids"])
    spec = run_server(case, log_dir / f"{name}-plugin.log", speculative=True)
    row["plugin_server"] = spec
    if "error" in spec:
        return row | {"status": "plugin server failed", "error": spec["error"]}
    try:
        ties = compare_greedy(case.target, PROMPTS, spec["output_ids"], plain["output_ids"])
    except AssertionError as e:
        return row | {"status": "outputs differ", "error": str(e)[:400]}
    row["ties"] = [f"sequence {d.sequence} token {d.position} margin {d.margin:.2g}" for d in ties]
    active = bool(spec["plugin"]) and spec["plugin"][0][1] == TP
    return row | {"status": "served, equal to greedy" if active else "served, plugin line missing"}


def table(rows: list[dict]) -> str:
    """The sweep as a fixed-width text table, with each failure's error below it."""
    lines = [f"{'architecture':<28} {'target class':<32} {'algo':<6} {'result':<28} {'accept len':<18} "
             f"{'plain = HF':<20} plugin line", "-" * 157]  # fmt: skip
    notes = []
    for row in rows:
        spec = row.get("plugin_server", {})
        accept = "/".join(f"{a:.2f}" for a in spec.get("accept_lengths") or [] if a is not None) or "-"
        plugin = ", ".join(f"{n} hot ids, tp {tp}, {layout}/{exchange}" for n, tp, layout, exchange in
                           spec.get("plugin", [])) or "-"  # fmt: skip
        hf = row.get("plain_equals_hf", "-").split(":")[0]
        lines.append(f"{row['name']:<28} {row['target']:<32} {row['algorithm']:<6} {row['status']:<28} "
                     f"{accept:<18} {hf:<20} {plugin}")  # fmt: skip
        if "error" in row:
            notes.append(f"{row['name']}: {row['error']}")
        if row.get("plain_equals_hf", "yes").startswith(("no", "not")):
            notes.append(f"{row['name']}: plain SGLang vs HF: {row['plain_equals_hf']}")
        for tie in row.get("ties", []):
            notes.append(f"{row['name']}: accepted near-tie at {tie}")
    return "\n".join(lines + ([""] + notes if notes else []))


def write(out: Path, rows: list[dict]) -> None:
    """OUT.json (settings and rows) and OUT.txt (the table)."""
    meta = {"tp": TP, "new_tokens": NEW_TOKENS, "prompts": PROMPTS}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".txt").write_text(table(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SWEPT), help="architectures to serve")
    parser.add_argument(
        "--out", type=Path, help="write OUT.txt (table) and OUT.json (rows); rows of an existing OUT.json "
        "for architectures not served now are kept"
    )  # fmt: skip
    parser.add_argument("--report", type=Path, help="reprint the table of a saved OUT.json")
    args = parser.parse_args(argv)
    if args.report:
        print(table(json.loads(args.report.read_text())["rows"]))
        return 0
    log_dir = Path(tempfile.mkdtemp(prefix="arch-sweep-"))
    rows = {}
    if args.out and args.out.with_suffix(".json").exists():
        rows = {row["name"]: row for row in json.loads(args.out.with_suffix(".json").read_text())["rows"]}
    for name in args.only or SWEPT:
        print(f"== {name}", flush=True)
        rows[name] = sweep_one(name, log_dir) | {"logs": shown_path(log_dir), "cpu_count": os.cpu_count()}
        print(f"   {rows[name]['status']}: {rows[name].get('error', '')}", flush=True)
        if args.out:  # after every architecture, so an interrupted sweep keeps what it served
            write(args.out, [rows[n] for n in SWEPT if n in rows])
    print(table([rows[n] for n in SWEPT if n in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
