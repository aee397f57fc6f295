"""Bar charts of how a token map's hot ids spread over the ranks of a vocab-parallel head."""

from __future__ import annotations

import os
from collections.abc import Sequence

from sglang_frspec.core import HotShardPlan
from sglang_frspec.maps.errors import MapBuildError


def plot_plans(plans: Sequence[HotShardPlan], path: str | os.PathLike) -> None:
    """Save a PNG with, for each rank, one bar per layout: the hot columns that rank computes."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or GUI needed
    except ImportError as e:
        raise MapBuildError("--plot needs matplotlib: pip install matplotlib") from e
    tp, num_hot = plans[0].tp_size, plans[0].num_hot
    figure = Figure(figsize=(max(7.5, 3.0 + 1.1 * tp), 4.5), layout="constrained")
    axes = figure.subplots()
    bar_width = 0.8 / len(plans)
    for i, plan in enumerate(plans):
        offset = (i - (len(plans) - 1) / 2) * bar_width
        bars = axes.bar(
            [rank + offset for rank in range(tp)],
            plan.counts,
            bar_width,
            label=f"{plan.layout} ({plan.width:,} slots per rank)",
        )
        axes.bar_label(bars, fmt="{:,.0f}", fontsize=8)
    axes.axhline(num_hot / tp, color="black", linestyle="--", linewidth=1, label=f"mean {num_hot / tp:,.0f}")
    axes.set_xticks(
        range(tp), [f"rank {r}\nids [{s:,}, {e:,})" for r, (s, e) in enumerate(plans[0].shard_ranges)]
    )
    axes.tick_params(axis="x", labelsize=8)
    axes.set_ylabel("hot ids computed by the rank")
    axes.yaxis.set_major_formatter("{x:,.0f}")
    axes.set_ylim(top=max(max(p.counts) for p in plans) * 1.08)  # room for the bar labels
    imbalances = ", ".join(f"{p.layout} {p.imbalance:.2f}" for p in plans)
    axes.set_title(f"{num_hot:,} hot ids over TP={tp}: max/mean {imbalances}", pad=22)
    # Above the axes, so it never hides a bar whatever the skew.
    axes.legend(
        loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(plans) + 1, fontsize=8, frameon=False
    )
    figure.savefig(path, dpi=120)
