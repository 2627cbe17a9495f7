"""PNG charts of a report (matplotlib Agg, no display): step-time breakdown per rank, top operators."""

from __future__ import annotations

from pathlib import Path

from tasks.fsutil import atomic_save_figure

_PARTS = [
    ("computing", "Computing", "#4C72B0"),
    ("comm_not_overlapped", "Communication (not overlapped)", "#DD8452"),
    ("free", "Free", "#BBBBBB"),
]
_CAT_COLORS = {
    "cube/matmul": "#4C72B0",
    "attention": "#8172B3",
    "vector": "#55A868",
    "ai_cpu": "#C44E52",
    "communication": "#DD8452",
}


def _save(fig, path: Path) -> Path:
    return atomic_save_figure(fig, path, dpi=110, bbox_inches="tight")


def step_breakdown(report: dict, path: Path) -> Path:
    """Stacked bars: mean step split per rank (the three parts tile the step); overlapped and bubble as marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = report["ranks"]
    labels = [f"rank {r['rank']}" for r in ranks]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(ranks) + 3), 4))
    bottom = [0.0] * len(ranks)
    for key, label, color in _PARTS:
        vals = [r["mean"][f"{key}_us"] / 1000 for r in ranks]
        ax.bar(labels, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bubble = [r["mean"]["bubble_us"] / 1000 for r in ranks]
    if any(bubble):
        ax.scatter(labels, bubble, marker="_", s=400, color="black", label="of which bubble", zorder=3)
    ax.set_ylabel("ms per step")
    ax.set_title("Step time breakdown per rank")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def top_ops(report: dict, path: Path, n: int = 12) -> Path | None:
    rows = report["top_ops"][:n]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [r["name"][:48] for r in rows][::-1]
    vals = [r["total_us"] / 1000 for r in rows][::-1]
    colors = [_CAT_COLORS.get(r["category"], "#999999") for r in rows][::-1]
    ax.barh(names, vals, color=colors)
    ax.set_xlabel("total ms over the profiled steps, all ranks")
    ax.set_title("Top operators (colour = category)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _CAT_COLORS.values()]
    ax.legend(handles, list(_CAT_COLORS), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
