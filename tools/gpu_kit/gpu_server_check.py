"""Steps of the first real SGLang GPU server check with this plugin (run by gpu_server_check.sh).

    python -m tools.gpu_kit.gpu_server_check env                  # the environment, as shell exports
    python -m tools.gpu_kit.gpu_server_check imports              # CUDA-path imports, plugins, kernels
    python -m tools.gpu_kit.gpu_server_check fixture DIR          # build the permutation fixture
    python -m tools.gpu_kit.gpu_server_check serve DIR graphs OUT # TP=1 EAGLE + map + plugin server
    python -m tools.gpu_kit.gpu_server_check serve DIR eager OUT  # the same with --disable-cuda-graph

The server runs the permutation fixture (``sglang_frspec.demo.fixtures``): greedy decoding
follows x -> pi(x), and every draft token of a chain inside the hot map is accepted. Each serve
step sends greedy requests (a chain, a prompt outside the map, a batch of 4 chains), checks the
outputs against greedy decoding computed from the target's weights (its next token depends on
the last token only), the accept lengths against the fixture's, the server log for the plugin's
line (and, with graphs, both draft graphs captured), and writes what it saw to
``OUT/server_<mode>.json``; the eager step also requires the graphs step's outputs.
Needs the environment gpu_server_check.sh sets (the kit on PYTHONPATH, SGLANG_PLUGINS, ...).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import signal
import sys
import time
from pathlib import Path

from sglang_frspec.demo.cpu import eagle_args
from sglang_frspec.demo.server import SGLangServer, plugin_activity

# What a TP=1 EAGLE server imports on CUDA with this check's flags, and what eagle_worker_v2
# imports lazily there (the attention backends whose draft-extend graphs it can capture).
CUDA_PATH_MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
    "sglang.srt.layers.attention.dsa_backend",
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.attention.flashmla_backend",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle",
    "sglang.kernels.ops.speculative.spec_tree",
)
PLUGINS = "frspec,frspec_gpu_check"  # this project's plugin and the check's (tools/gpu_kit/gpu_site)
# Environment of every step (gpu_server_check.sh exports it from `env`): SGLang's torch versions of
# the fused ops (rmsnorm, silu_and_mul, rotary) instead of JIT kernels; no build of tvm-ffi's torch
# DLPack extension at import (a compile on every fresh machine); no torch.compile; the Python
# radix-tree core (the Rust one is pruned from the kit); the plugins to load.
DEVICE_ENV = {
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "SGLANG_PLUGINS": PLUGINS,
}
# SGLang's hook registry logs one line per target it patched.
HOOK_LINES = (
    "Applied 1 hook(s) to sglang.kernels.ops.speculative.tree.build_tree_kernel_efficient",
    "Applied 1 hook(s) to sglang.kernels.ops.speculative.tree.verify_tree_greedy",
)
GRAPH_LINES = ("Capture draft decode CUDA graph end.", "Capture draft extend CUDA graph end.")
# Flags that keep the server on what the device has: Triton attention, torch sampling (greedy
# only: speculative sampling needs flashinfer), no grammar, no custom all-reduce, no prefill graph.
DEVICE_ARGS = [
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--disable-custom-all-reduce",
    "--cuda-graph-backend-prefill",
    "disabled",
]
STEPS, TOPK, DRAFT_TOKENS = 2, 2, 4  # as the CPU tests: every verify step commits 3 tokens
FULL_ACCEPT = float(STEPS + 1)
NEW_TOKENS = 24
CHAIN_STARTS = (0, 17, 33, 50)


def import_cuda_path() -> None:
    """Import CUDA_PATH_MODULES and load SGLang's plugins; fail unless both plugins hooked SGLang."""
    for name in CUDA_PATH_MODULES:
        importlib.import_module(name)
    from sglang.kernels.ops.speculative import spec_tree, tree
    from sglang.srt.plugins import load_plugins

    jit = (tree.build_tree_kernel_efficient, tree.verify_tree_greedy)
    load_plugins()
    now = (tree.build_tree_kernel_efficient, tree.verify_tree_greedy)
    if not all(fn is not old and fn.__wrapped__ is old for fn, old in zip(now, jit)):
        raise SystemExit(f"{PLUGINS}: the JIT tree functions were not replaced: {now}")
    if spec_tree.sgl_build_tree_kernel_efficient is not tree.build_tree_kernel_efficient:
        raise SystemExit("spec_tree still calls the JIT tree build")
    from sglang_frspec.adapters.args import MAP_HOOKS

    for target in MAP_HOOKS:
        if not hasattr(pkgutil.resolve_name(target), "__wrapped__"):
            raise SystemExit(f"the frspec plugin did not hook {target}: see its log line above")
    import sglang
    import torch
    import triton

    print(f"imports: {len(CUDA_PATH_MODULES)} CUDA-path modules imported; plugins {PLUGINS} loaded")
    print(f"versions: sglang {sglang.__version__}, torch {torch.__version__}, triton {triton.__version__}")


def check_tree_kernels(device: str, batch: int = 3, seeds: int = 20) -> None:
    """SGLang's tree build and greedy verify as the check plugin replaced them (Triton) against the
    CPU stand-in's Python port, on EAGLE trees drawn by SGLang's own draft-step code."""
    import collections

    import torch
    from sgl_kernel import _impl  # the CPU stand-in's reference ops
    from sglang.kernels.ops.speculative import tree
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    steps, topk, num_draft, vocab = 3, 2, 6, 3  # 3 token ids: random targets accept some drafts
    accepted_counts = collections.Counter()
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        scores, tree_info = None, ([], [], [])
        for i in range(steps):
            rows = batch if i == 0 else batch * topk
            probs = torch.softmax(torch.randn(rows, vocab, generator=gen), -1)
            topk_p, topk_index = probs.topk(topk, dim=-1)
            _, _, scores, info = select_top_k_tokens(i, topk_p, topk_index, None, scores, topk)
            for collected, part in zip(tree_info, info):
                collected.append(part)
        parent_list, selected, draft = organize_draft_results(*tree_info, num_draft)
        seq_lens = torch.randint(1, 9, (batch,), generator=gen)
        bonus = torch.randint(0, vocab, (batch, 1), generator=gen)
        candidates = torch.cat([bonus, draft], dim=1)
        target = torch.randint(0, vocab, (batch, num_draft), generator=gen)
        built = {}
        for name, build in (
            ("triton", tree.build_tree_kernel_efficient),
            ("reference", _impl.build_tree_kernel_efficient_cpu),
        ):
            mask = torch.ones(
                int(seq_lens.sum()) * num_draft + num_draft * num_draft * batch, dtype=torch.bool
            )
            out = [
                mask,
                torch.zeros(batch * num_draft, dtype=torch.long),
                *torch.full((3, batch, num_draft), -1),
            ]
            out = [t.to(device) for t in out]
            args = [parent_list, selected, seq_lens]
            build(*[t.to(device) for t in args], *out, topk, steps, num_draft, 0)  # 0: FULL_MASK
            retrieve = out[2:]
            predict = torch.zeros(batch * num_draft, dtype=torch.int32, device=device)
            accept = torch.full((batch, steps + 1), -1, dtype=torch.int32, device=device)
            accepted = torch.zeros(batch, dtype=torch.int32, device=device)
            verify = tree.verify_tree_greedy if name == "triton" else _impl.verify_tree_greedy_cpu
            verify(predict, accept, accepted, candidates.to(device), *retrieve, target.to(device))
            built[name] = [t.cpu() for t in (*out, predict, accept, accepted)]
        names = ("tree_mask", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")
        names += ("predicts", "accept_index", "accept_token_num")
        differ = [n for n, a, b in zip(names, built["triton"], built["reference"]) if not torch.equal(a, b)]
        if differ:
            raise SystemExit(f"tree kernels (seed {seed}): {differ} differ from the CPU stand-in's")
        accepted_counts.update(built["reference"][-1].tolist())
    if set(accepted_counts) != set(range(steps + 1)):  # else some verify paths went unchecked
        raise SystemExit(
            f"tree kernels: accepted drafts per request {sorted(accepted_counts)}, not 0..{steps}"
        )
    print(
        f"tree kernels: Triton build + greedy verify equal the reference on {seeds} EAGLE trees "
        f"({device}; requests accepting 0..{steps} drafts: {[accepted_counts[n] for n in range(steps + 1)]})"
    )


def build_fixture(cache: Path) -> Path:
    """Build the permutation fixture under ``cache`` (as the CPU tests do); returns its folder."""
    os.environ["SGLANG_FRSPEC_CACHE"] = str(cache)
    from sglang_frspec.demo.fixtures import perm_fixture

    return perm_fixture().root


def greedy_reference(target: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding of the fixture's target from its weights: its final hidden state is
    RMSNorm(embed(last token)), so the next token is argmax(head @ embed[last])."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(target) / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    outputs = []
    for prompt in prompts:
        ids = [prompt[-1]]
        for _ in range(new_tokens):
            ids.append(int((head @ embed[ids[-1]]).argmax()))
        outputs.append(ids[1:])
    return outputs


def server_args(root: Path, mode: str) -> list[str]:
    """Launch arguments of the check's server: TP=1, EAGLE with the fixture's hot map, this plugin."""
    args = ["--model-path", str(root / "target"), "--tp-size", "1", "--dtype", "bfloat16"]
    args += eagle_args(
        str(root / "draft"), str(root / "map_hot.pt"), steps=STEPS, topk=TOPK, draft_tokens=DRAFT_TOKENS
    )
    args += DEVICE_ARGS + ["--cuda-graph-max-bs-decode", "8", "--max-running-requests", "8"]
    args += ["--max-total-tokens", "65536", "--skip-server-warmup", "--log-level", "info"]
    return args + (["--disable-cuda-graph"] if mode == "eager" else [])


def serve(root: Path, mode: str, out: Path) -> dict:
    """Run one server and its requests; return what was seen and the failed checks."""
    import torch

    chain = json.loads((root / "chains.json").read_text())["chain"]
    cold = torch.load(root / "map_cold.pt").tolist()
    num_hot = len(set(torch.load(root / "map_hot.pt").tolist()))
    prompts = {"chain": [chain[:3]], "cold": [cold[:2]], "batch": [chain[s : s + 3] for s in CHAIN_STARTS]}
    log_path = out / f"server_{mode}.log"
    started = time.monotonic()
    with SGLangServer(server_args(root, mode), dict(os.environ), log_path) as server:
        ready_s = time.monotonic() - started
        seen = {}
        for name, batch in prompts.items():
            outs = server.generate(batch if name == "batch" else batch[0], NEW_TOKENS)
            outs = outs if isinstance(outs, list) else [outs]
            seen[name] = {
                "output_ids": [o["output_ids"] for o in outs],
                "accept_length": [o["meta_info"].get("spec_accept_length") for o in outs],
            }
        log = server.log()
    expected = {
        name: greedy_reference(str(root / "target"), batch, NEW_TOKENS) for name, batch in prompts.items()
    }
    failed = [
        f"{name}: output differs from greedy"
        for name in prompts
        if seen[name]["output_ids"] != expected[name]
    ]
    for name in ("chain", "batch"):  # inside the map: every draft token is accepted
        if seen[name]["accept_length"] != [FULL_ACCEPT] * len(prompts[name]):
            failed.append(f"{name}: accept length {seen[name]['accept_length']}, expected {FULL_ACCEPT}")
    if plugin_activity(log) != [(num_hot, 1, "balanced", "full")]:
        failed.append(f"plugin line: {plugin_activity(log)}, expected one for {num_hot} hot ids at TP=1")
    graph_lines = {line: line in log for line in GRAPH_LINES}
    if mode == "graphs" and not all(graph_lines.values()):
        failed.append(f"draft graphs not both captured: {graph_lines}")
    return {
        "mode": mode,
        "ready_s": round(ready_s, 1),
        "seen": seen,
        "graph_lines": graph_lines,
        "hook_lines": {line: line in log for line in HOOK_LINES},
        "failed": failed,
    }


def parser() -> argparse.ArgumentParser:
    """The command line of the steps (gpu_server_check.sh calls each)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    steps.add_parser("env", help="print DEVICE_ENV as shell export lines")
    imports = steps.add_parser("imports")
    imports.add_argument("--device", default="cuda", help="where the tree-kernel check runs")
    fixture = steps.add_parser("fixture")
    fixture.add_argument("cache", type=Path)
    run = steps.add_parser("serve")
    run.add_argument("cache", type=Path)
    run.add_argument("mode", choices=("graphs", "eager"))
    run.add_argument("out", type=Path)
    return parser


def main() -> None:
    args = parser().parse_args()
    # The shell script's step limit sends SIGTERM: exit through `with SGLangServer`, which stops
    # the server (it runs in a session of its own and would outlive this process).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"{args.step}: terminated (time limit)"))
    if args.step == "env":
        print("\n".join(f"export {key}={value}" for key, value in DEVICE_ENV.items()))
    elif args.step == "imports":
        import_cuda_path()
        check_tree_kernels(args.device)
    elif args.step == "fixture":
        print(f"fixture: {build_fixture(args.cache)}")
    else:
        result = serve(build_fixture(args.cache), args.mode, args.out)
        graphs_result = args.out / "server_graphs.json"
        if args.mode == "eager" and not graphs_result.is_file():
            result["failed"].append("no graphs result to compare with")
        elif args.mode == "eager" and json.loads(graphs_result.read_text())["seen"] != result["seen"]:
            result["failed"].append("eager outputs or accept lengths differ from the graphs server's")
        (args.out / f"server_{args.mode}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: result[k] for k in ("mode", "ready_s", "graph_lines", "hook_lines", "failed")}))
        if result["failed"]:
            raise SystemExit(f"{args.mode}: " + "; ".join(result["failed"]))


if __name__ == "__main__":
    main()
