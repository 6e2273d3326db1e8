"""The adapter-scaling curve as one PNG: measured throughput relative to 1 adapter, and the floor's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .scaling import ScalingPoint


def plot_scaling(points: Sequence[ScalingPoint], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on these machines
    import matplotlib.pyplot as plt

    xs = [p.adapters for p in points]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(xs, [p.relative_throughput for p in points], "o-", label="loraplex, measured")
    ax.plot(xs, [1.0 - (p.predicted_loss or 0.0) for p in points], "s--", label="floor-predicted")
    for p in points:
        ax.annotate(f"host miss {p.host_cache['misses']}\npool evict {p.pool_evictions}",
                    (p.adapters, p.relative_throughput), textcoords="offset points", xytext=(4, -26), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("distinct adapters in the trace")
    ax.set_ylabel("throughput relative to 1 adapter")
    ax.set_ylim(0, max(1.1, max(p.relative_throughput for p in points) * 1.05))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
