"""Per-rank draft-head work of each layout on ONE device, against the memory-bandwidth bound.

The draft LM head at small row counts is a weight-streaming GEMM: its floor is the head's bytes
divided by the device's memory bandwidth. This script times, on a single device and without
SGLang (torch + this project's plans only), the work the slowest rank does in one draft step
for each layout at emulated TP sizes:

  (a) stock     the rank's full-vocab shard, padded V/tp rows (what TP users run today);
  (b) local     the plan's padded width P = max n_r rounded up (every rank computes P rows);
  (b) balanced  ceil(H/tp) rows;
  (c) tp1       the TP=1 FR-Spec head, H rows (tp=1 only).

Each variant is "GEMM + cast to float32"; the ``+topk`` variants add the per-rank part of the
top-k exchange (top-k, log-sum-exp of the rest) for the rank holding the most hot ids. The
collective is not timed here (see bench_draft_head.py for whole steps on a real group).

On CUDA with triton, each hot-head variant also times this project's kernels
(sglang_frspec.kernels): ``triton gemv`` (split-K GEMV + cast), ``packet torch`` / ``packet
triton`` (the packet alone, on ready logits: head rows 0, no bound), ``triton gemv, packet``
(GEMV then the packet kernel) and ``triton gemv+packet`` (fused: the logits are never written).

The bound is measured in the same run: an elementwise kernel streaming a large buffer gives the
bandwidth (bytes read plus written), and each variant's bound is its weight bytes at that
bandwidth. Weights are cycled through enough copies that the working set exceeds the last-level
cache. On CUDA each repeat replays a CUDA graph of ``--iters`` steps (as SGLang's draft graphs
do), timed with events.

    python -m benchmarks.bench_head_gemm --device cuda --json gemm.json   # one GPU
    python -m benchmarks.bench_head_gemm                                   # CPU, fp32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import add_head_args, head_dtype, hot_map, rotated, shown_paths, summarize
from sglang_frspec.core import HotLogitsExchange, plan_hot_shards, vocab_shard_ranges


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_head_args(p)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="emulated TP sizes")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--iters", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--working-set-mb", type=int, default=512, help="cycle weight copies to exceed caches")
    p.add_argument("--json", help="write the results here as JSON")
    return p.parse_args(argv)


class Timer:
    """Times ``iters`` calls of a step: a replayed CUDA graph on CUDA, a plain loop on CPU."""

    def __init__(self, step, iters: int, device: torch.device):
        self.iters, self.cuda = iters, device.type == "cuda"
        if not self.cuda:
            self.run = lambda: [step(i) for i in range(iters)]
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(iters):  # warm-up outside the graph (cuBLAS workspaces)
                step(i)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for i in range(iters):
                step(i)
        self.run = self.graph.replay

    def seconds_per_step(self) -> float:
        if not self.cuda:
            start = time.perf_counter()
            self.run()
            return (time.perf_counter() - start) / self.iters
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        self.run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / self.iters


def stream_bandwidth(device: torch.device, megabytes: int, repeats: int) -> float:
    """Bytes per second of an elementwise kernel streaming a buffer, counting reads plus writes.

    A kernel, not ``copy_``: on an H200 a graph-captured ``copy_`` measured 2.75 TB/s, below the
    4.2 TB/s the full-vocab head GEMM itself streamed, so it would not bound anything.
    """
    src = torch.ones(megabytes * 2**18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer = Timer(lambda i: torch.mul(src, 2.0, out=dst), 5, device)
    seconds = summarize([timer.seconds_per_step() for _ in range(repeats)])["median"]
    return 2 * src.numel() * src.element_size() / seconds


def head_rows(args, hot: torch.Tensor, tp: int) -> dict[str, tuple[int, HotLogitsExchange | None]]:
    """Rows of the slowest rank's head per variant, and (for +topk) its exchange."""
    first, end = vocab_shard_ranges(args.vocab, tp)[0]
    variants = {"(a) stock": (end - first, None)}
    if tp == 1:
        plan = plan_hot_shards(hot, args.vocab, 1)
        return {**variants, "(c) tp1": (plan.width, HotLogitsExchange(plan, 0))}
    for layout in ("local", "balanced"):
        plan = plan_hot_shards(hot, args.vocab, tp, layout=layout)
        busiest = max(range(tp), key=lambda r: plan.counts[r])
        variants[f"(b) {layout}"] = (plan.width, HotLogitsExchange(plan, busiest))
    return variants


def build_steps(args, hot, tp, rows, dtype, device) -> dict[str, tuple[Callable, int]]:
    """Step functions (argument: step index, to cycle weight copies) and head rows per variant."""
    hidden = torch.randn(rows, args.hidden, device=device, dtype=dtype)
    steps = {}
    for name, (num_rows, exchange) in head_rows(args, hot, tp).items():
        weight_bytes = num_rows * args.hidden * dtype.itemsize
        copies = max(1, -(-args.working_set_mb * 2**20 // weight_bytes))
        weights = [
            torch.randn(num_rows, args.hidden, device=device, dtype=dtype) * 0.02 for _ in range(copies)
        ]

        def gemm(i, weights=weights):
            return (hidden @ weights[i % len(weights)].T).float()

        steps[name] = (gemm, num_rows)
        if exchange is not None and exchange.count > args.topk:
            steps[name + "+topk"] = (
                lambda i, gemm=gemm, exchange=exchange: exchange.topk_packet_reference(gemm(i), args.topk),
                num_rows,
            )
            if kernels is not None:
                steps.update(kernel_steps(name, weights, hidden, exchange, args.topk, num_rows))
    return steps


def kernel_steps(name, weights, hidden, exchange, k, num_rows) -> dict[str, tuple[Callable, int]]:
    """The Triton kernels' variants of one hot head (CUDA only)."""
    count, offset = exchange.count, exchange.offset
    logits = hidden @ weights[0].T

    def weight(i):
        return weights[i % len(weights)]

    return {
        f"{name} triton gemv": (lambda i: gemv.hot_head_gemv(hidden, weight(i)).float(), num_rows),
        f"{name} packet torch": (lambda i: exchange.topk_packet_reference(logits, k), 0),
        f"{name} packet triton": (lambda i: kernels.topk_packet(logits, count, offset, k), 0),
        f"{name} triton gemv, packet": (
            lambda i: kernels.topk_packet(gemv.hot_head_gemv(hidden, weight(i)), count, offset, k),
            num_rows,
        ),
        f"{name} triton gemv+packet": (
            lambda i: gemv.gemv_topk_packet(hidden, weight(i), count, offset, k),
            num_rows,
        ),
    }


kernels = None  # sglang_frspec.kernels on CUDA with triton (main sets it)
gemv = None  # sglang_frspec.kernels.gemv, likewise (benchmarked; the server does not use it)


def main(argv=None) -> int:
    global kernels, gemv
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        try:
            from sglang_frspec import kernels
            from sglang_frspec.kernels import gemv
        except ImportError:
            print("triton not importable: timing the torch variants only")
    dtype = head_dtype(args)
    torch.manual_seed(0)
    hot = hot_map(args.map, args.vocab, args.hot)
    bandwidth = stream_bandwidth(device, args.working_set_mb, args.repeats)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"per-rank draft-head work on one device ({device_name}), {dtype}, V={args.vocab} H={hot.numel()} "
        f"hidden={args.hidden} map={args.map} topk={args.topk}; stream bandwidth {bandwidth / 1e9:.0f} GB/s "
        f"(read+write); {args.repeats} interleaved repeats x {args.iters} steps"
    )
    print(
        f"\n{'tp':>2} {'rows':>4}  {'variant':<33} {'head rows':>9} {'weight MB':>9} {'median us':>10} "
        f"{'p25-p75 us':>15} {'bound us':>9} {'of bound':>8} {'vs (a)':>7}"
    )
    results = []
    for tp in args.tp:
        for rows in args.rows:
            steps = build_steps(args, hot, tp, rows, dtype, device)
            timers = {name: Timer(step, args.iters, device) for name, (step, _) in steps.items()}
            names = list(timers)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for repeat in range(args.repeats):
                for name in rotated(names, repeat):
                    samples[name].append(timers[name].seconds_per_step())
            stock = summarize(samples["(a) stock"])["median"]
            for name in names:
                stats, num_rows = summarize(samples[name]), steps[name][1]
                weight_bytes = num_rows * args.hidden * dtype.itemsize
                bound = weight_bytes / bandwidth  # 0 for the packet alone (no weight)
                result = {
                    "tp": tp,
                    "rows": rows,
                    "variant": name,
                    "head_rows": num_rows,
                    "weight_mb": weight_bytes / 1e6,
                    "median_us": stats["median"] * 1e6,
                    "p25_us": stats["p25"] * 1e6,
                    "p75_us": stats["p75"] * 1e6,
                    "bound_us": bound * 1e6,
                    "fraction_of_bound": bound / stats["median"],
                    "speedup_vs_stock": stock / stats["median"],
                }
                results.append(result)
                print(
                    f"{tp:>2} {rows:>4}  {name:<33} {result['head_rows']:>9} {result['weight_mb']:>9.1f} "
                    f"{result['median_us']:>10.1f} {result['p25_us']:>7.1f}-{result['p75_us']:<7.1f} "
                    f"{result['bound_us']:>9.1f} {result['fraction_of_bound']:>7.0%} "
                    f"{result['speedup_vs_stock']:>6.2f}x"
                )
            del steps, timers
    if args.json:
        record = {"args": vars(args), "device": device_name, "bandwidth": bandwidth, "results": results}
        Path(args.json).write_text(json.dumps(shown_paths(record), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
