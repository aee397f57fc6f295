"""Shared pieces of the benchmark scripts: synthetic hot maps, interleaved timing stats and the
paths that results print."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from pathlib import Path

import torch

from sglang_frspec.demo.fixtures import cache_root

REPO = Path(os.path.abspath(__file__)).parent.parent

# Hot ids per eighth of a Llama-3 vocab for a top-32768 map (the reference anchors' estimate:
# TP8 per-rank counts; summing neighbours gives the TP4 and TP2 rows of the same table).
LLAMA3_EIGHTHS = (11833, 7440, 4696, 3446, 2656, 2089, 522, 86)


def skewed_map(vocab: int, num_hot: int, seed: int = 0) -> torch.Tensor:
    """Hot ids spread over the vocab like a real BPE frequency map (frequent ids are small).

    Each eighth of the vocab gets the share of hot ids the Llama-3 estimate gives it, so at
    V=128256 and H=32768 the TP2/4/8 max/mean imbalance is 1.67/2.35/2.89.
    """
    gen = torch.Generator().manual_seed(seed)
    shares = torch.tensor(LLAMA3_EIGHTHS, dtype=torch.float64)
    counts = torch.floor(shares / shares.sum() * num_hot).long()
    counts[0] += num_hot - int(counts.sum())
    edges = [round(vocab * i / 8) for i in range(9)]
    ids = []
    for i, n in enumerate(counts.tolist()):
        width = edges[i + 1] - edges[i]
        ids.append(edges[i] + torch.randperm(width, generator=gen)[: min(n, width)])
    return torch.cat(ids).sort().values


def uniform_map(vocab: int, num_hot: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=gen)[:num_hot].sort().values


def hot_map(spec: str, vocab: int, num_hot: int) -> torch.Tensor:
    """``skewed``, ``uniform`` or the path of a token-map file."""
    if spec == "skewed":
        return skewed_map(vocab, num_hot)
    if spec == "uniform":
        return uniform_map(vocab, num_hot)
    from sglang_frspec.core import canonical_hot_ids, read_token_map

    return canonical_hot_ids(read_token_map(spec), vocab, source=spec).ids


def summarize(samples: list[float]) -> dict:
    """Median and interquartile range of repeated measurements."""
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "p25": quartiles[0], "p75": quartiles[2], "n": len(ordered)}


def median_interval(samples: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: order statistics ``x_(l) .. x_(n+1-l)``
    with the largest l such that P(l <= Binomial(n, 1/2) <= n - l) >= ``confidence``."""
    ordered = sorted(samples)
    n = len(ordered)
    cdf, lower = 0.0, 0  # cdf = P(Binomial(n, 1/2) < lower + 1)
    for k in range(n // 2 + 1):
        cdf += math.comb(n, k) / 2**n
        if 1 - 2 * cdf < confidence:
            break
        lower = k + 1
    if lower == 0:
        return ordered[0], ordered[-1]  # too few samples for this confidence: the full range
    return ordered[lower - 1], ordered[n - lower]


def add_head_args(p: argparse.ArgumentParser) -> None:
    """The draft-head shape, dtype and map options both head benchmarks take."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="head dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hot", type=int, default=32768, help="hot ids H (synthetic maps)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--map", default="skewed", help="skewed (BPE-like), uniform, or a map file")
    p.add_argument("--topk", type=int, default=4, help="k of the top-k exchange (EAGLE topk)")


def head_dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))


def rotated(names: list[str], repeat: int) -> list[str]:
    """The order of one interleaved repeat: each repeat starts one variant later."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def _shown_roots() -> tuple[tuple[str, Path], ...]:
    """The folders results name paths under, by label, the most specific first."""
    return (
        ("<cache>", cache_root()),
        (".", REPO),
        ("<tmp>", Path(tempfile.gettempdir())),
        ("~", Path.home()),
    )


def shown_path(path: str | os.PathLike) -> str:
    """``path`` as results print it, never absolute, so a result reads the same on every machine:
    under ``<cache>`` (the fixture cache, ``cache_root()``), relative to the repository, or under
    ``<tmp>`` or ``~``; elsewhere only its name (``.../name``)."""
    path = Path(os.path.abspath(path))
    for label, root in _shown_roots():
        root = Path(os.path.abspath(root))
        if path.is_relative_to(root):
            return (Path(label) / path.relative_to(root)).as_posix()
    return f".../{path.name}"


def shown_paths(data: object) -> object:
    """JSON-able ``data`` with every absolute path in it (a string or ``os.PathLike``) as ``shown_path``."""
    if isinstance(data, dict):
        return {key: shown_paths(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [shown_paths(value) for value in data]
    if isinstance(data, os.PathLike) or (isinstance(data, str) and os.path.isabs(data)):
        return shown_path(data)
    return data


def local_path(shown: str) -> str:
    """This machine's path of a ``shown_path`` under ``<cache>``, ``<tmp>`` or ``~`` (a result's
    map, read back); any other path as it is."""
    label, _, rest = shown.partition("/")
    roots = {name: root for name, root in _shown_roots() if name != "."}  # "." paths: as they are
    return str(roots[label] / rest) if label in roots else shown


def fixture_map(fixture, name: str) -> str:
    """The path of a trained-fixture map by name (``code_128``), or ``name`` itself if it is a file
    (also as a result shows it: ``<tmp>/maps/m.pt``)."""
    path = local_path(name)
    return path if os.path.isfile(path) else fixture.token_map(name)
