"""One draft LM-head step (local GEMM, gather, compaction), measured side by side.

Variants, all on SGLang's own process groups and classes:
  (a) stock    SGLang's full-vocab vocab-parallel head + LogitsProcessor at TP=N (what TP users
               run today, since a token map crashes);
  (b) plugin   FrSpecLogitsProcessor for each layout (local, balanced) x exchange (full, topk,
               auto: full or topk per row count, by core.exchange_rule.auto_exchange);
  (c) tp1      the TP=1 FR-Spec head, h @ W[hot].T on one rank (no collective).

Run on one machine (the script starts its own ranks with torch.distributed.run):
    python -m benchmarks.bench_draft_head --tp 2                       # CPU, gloo
    python -m benchmarks.bench_draft_head --tp 8 --device cuda         # one node, NCCL
or under torchrun on many GPUs:
    torchrun --nproc-per-node 8 --module benchmarks.bench_draft_head --device cuda

Repeats are interleaved across variants; each step's time is the slowest rank's. Prints a table
(median, interquartile range, speed-up vs (a), bytes gathered per step, columns per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from benchmarks.common import add_head_args, head_dtype, hot_map, rotated, shown_paths, summarize

STOCK, TP1 = "(a) stock full vocab", "(c) tp1 fr-spec head"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="ranks (ignored under torchrun: WORLD_SIZE)")
    add_head_args(p)
    p.add_argument("--layouts", nargs="+", default=["local", "balanced"])
    p.add_argument("--exchanges", nargs="+", default=["full", "topk", "auto"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--plot", help="write a bar chart of speed-ups vs (a) here (PNG)")
    return p.parse_args(argv)


def relaunch(args: argparse.Namespace) -> int:
    """Start ``args.tp`` ranks of this script with torch.distributed.run."""
    from sglang_frspec.demo.cpu import cpu_env
    from sglang_frspec.demo.server import free_port

    env = cpu_env(args.tp) if args.device == "cpu" else dict(os.environ)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.tp}",
        f"--master-port={free_port()}",
        "--module",  # each rank runs ``python -m benchmarks.bench_draft_head`` from the repository root
        "benchmarks.bench_draft_head",
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


def init_group(device: str, vocab: int) -> tuple[int, int, torch.device]:
    """SGLang's own distributed init under torchrun's environment."""
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    # SGLang resolves server arguments against a model config; a tiny local one will do.
    model_dir = tempfile.mkdtemp(prefix="frspec-bench-")
    LlamaConfig(
        vocab_size=vocab, hidden_size=64, num_attention_heads=4, architectures=["LlamaForCausalLM"]
    ).save_pretrained(model_dir)
    server_args = ServerArgs(
        model_path=model_dir,
        device=device,
        tp_size=world,
        attention_backend="torch_native" if device == "cpu" else None,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=local_rank))
    init_distributed_environment(
        backend="nccl" if device == "cuda" else "gloo",
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        distributed_init_method="env://",
    )
    initialize_model_parallel()
    return rank, world, torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")


def same_on_all_ranks(rows: int, hidden: int, dtype, device) -> torch.Tensor:
    """Hidden states every rank agrees on (as in a real draft step)."""
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(device, dtype)


def build_variants(args, dtype, device, world) -> tuple[dict, dict]:
    """Step functions keyed by variant name, and per-variant facts (bytes, columns)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, plan_from_ranges

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 128)
    )
    with torch.device(device):
        target = ParallelLMHead(args.vocab, args.hidden, params_dtype=dtype)
        target.weight.data.normal_(0, 0.02)
        tp1_head = torch.randn(args.hot, args.hidden, dtype=dtype) * 0.02
    stock = LogitsProcessor(config)
    shard = describe_head_shard(target)
    hot = hot_map(args.map, args.vocab, args.hot)
    itemsize = torch.finfo(dtype).bits // 8
    variants = {
        STOCK: lambda h: stock._get_logits(h, target, None, use_logits_buffer=False),
        TP1: lambda h: (h @ tp1_head.T).float(),
    }
    facts = {
        STOCK: {
            "bytes_per_row": dict.fromkeys(args.rows, world * target.num_embeddings_per_partition * itemsize),
            "columns": [target.num_embeddings_per_partition] * world,
        },
        TP1: {"bytes_per_row": dict.fromkeys(args.rows, 0), "columns": [args.hot]},
    }
    check = same_on_all_ranks(3, args.hidden, dtype, device)
    reference = stock._get_logits(check, target, None, use_logits_buffer=False)[:, hot.to(device)]
    for layout in args.layouts:
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        head = types.SimpleNamespace(
            weight=build_local_head(target.weight, plan, shard.rank, shard.all_gather)
        )
        for exchange in args.exchanges:
            processor = FrSpecLogitsProcessor(config, plan, shard, exchange, args.topk, device)
            name = f"(b) {layout}/{exchange}"

            def step(h, processor=processor, head=head):
                return processor._get_logits(h, head, None, use_logits_buffer=False)

            variants[name] = step
            if exchange == "full":  # the plugin's logits are the stock logits' hot columns
                torch.testing.assert_close(step(check), reference, rtol=2e-2, atol=2e-2)
            # What the processor runs at each row count (auto: the rule's pick).
            picks = {
                rows: processor.exchange_for_rows(torch.empty(rows, plan.width, dtype=dtype, device=device))
                for rows in args.rows
            }
            bytes_per_row = {
                "topk": plan.topk_bytes_per_row(args.topk),
                "full": plan.gathered_bytes_per_row(itemsize),
            }
            facts[name] = {
                "bytes_per_row": {rows: bytes_per_row[pick] for rows, pick in picks.items()},
                "picks": picks,
                "columns": list(plan.counts),
                "width": plan.width,
                "imbalance": round(plan.imbalance, 3),
            }
    facts[STOCK]["ideal_local_speedup"] = target.num_embeddings_per_partition / max(
        plan_from_ranges(hot, shard.shard_ranges, "local").counts
    )
    return variants, facts


def time_steps(variants: dict, rows: int, args, device, dtype) -> dict[str, list[float]]:
    """Interleaved repeats; each sample is the slowest rank's mean step time in seconds."""
    from sglang.srt.runtime_context import get_parallel

    cpu_group = get_parallel().tp_group.cpu_group
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    hidden = same_on_all_ranks(rows, args.hidden, dtype, device)
    names = list(variants)
    for name in names:  # warm-up (allocations, lazy communicator state)
        variants[name](hidden)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in rotated(names, repeat):
            torch.distributed.barrier(group=cpu_group)
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                variants[name](hidden)
            sync()
            elapsed = torch.tensor([(time.perf_counter() - start) / args.iters])
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX, group=cpu_group)
            samples[name].append(elapsed.item())
    return samples


def report(results: list[dict], facts: dict, args, world: int) -> None:
    print(
        f"\ndraft LM-head step: V={args.vocab} H={args.hot} hidden={args.hidden} tp={world} "
        f"dtype={results[0]['dtype']} device={args.device} map={args.map} topk={args.topk}; "
        f"{args.repeats} interleaved repeats x {args.iters} steps, slowest rank"
    )
    for name, fact in facts.items():
        print(
            f"  {name:<24} columns per rank {fact['columns']}"
            + (f" width {fact['width']} max/mean {fact['imbalance']}" if "width" in fact else "")
            + (f" runs {fact['picks']}" if name.endswith("/auto") else "")
        )
    print(
        f"\n{'rows':>4}  {'variant':<24} {'median ms':>10} {'p25-p75 ms':>15} {'vs (a)':>7} "
        f"{'gathered B/step':>15}"
    )
    for r in results:
        print(
            f"{r['rows']:>4}  {r['variant']:<24} {r['median_ms']:>10.3f} "
            f"{r['p25_ms']:>7.3f}-{r['p75_ms']:<7.3f} {r['speedup_vs_stock']:>6.2f}x "
            f"{r['bytes_per_step']:>15,}"
        )
    ideal = facts[STOCK]["ideal_local_speedup"]
    print(
        f"\n(V/tp)/max(n_r) for this map (ideal speed-up of the local layout): {ideal:.2f}; "
        f"V/H = {args.vocab / args.hot:.2f}"
    )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({r["rows"] for r in results})
    variants = [v for v in dict.fromkeys(r["variant"] for r in results) if v != STOCK]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ys = [
            next(r["speedup_vs_stock"] for r in results if r["rows"] == n and r["variant"] == variant)
            for n in rows
        ]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [x + width * (len(variants) - 1) / 2 for x in range(len(rows))], [f"{n} rows" for n in rows]
    )
    ax.set_ylabel("speed-up vs stock full-vocab head")
    ax.set_title("draft LM-head step, median of interleaved repeats")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return relaunch(args)
    rank, world, device = init_group(args.device, args.vocab)
    dtype = head_dtype(args)
    variants, facts = build_variants(args, dtype, device, world)
    results = []
    for rows in args.rows:
        samples = time_steps(variants, rows, args, device, dtype)
        stock_median = summarize(samples[STOCK])["median"]
        for name, values in samples.items():
            stats = summarize(values)
            results.append(
                {
                    "rows": rows,
                    "variant": name,
                    "median_ms": stats["median"] * 1e3,
                    "p25_ms": stats["p25"] * 1e3,
                    "p75_ms": stats["p75"] * 1e3,
                    "speedup_vs_stock": stock_median / stats["median"],
                    "bytes_per_step": facts[name]["bytes_per_row"][rows] * rows,
                    "exchange": facts[name].get("picks", {}).get(rows, ""),
                    "dtype": str(dtype),
                    "tp": world,
                    "device": args.device,
                }
            )
    if rank == 0:
        report(results, facts, args, world)
        if args.json:
            Path(args.json).write_text(
                json.dumps(shown_paths({"args": vars(args), "facts": facts, "results": results}), indent=1)
            )
        if args.plot:
            plot(results, args.plot)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
