"""The FP-vs-INT8 comparison as a table (JSON rows + markdown) and a figure, for MLflow and for a human."""
from __future__ import annotations

COLORS = {"FP32": "#4c72b0", "BF16": "#8c8c8c", "INT8": "#dd8452"}


def comparison_rows(m: dict) -> list[dict]:
    """`m` holds the evaluate metrics (fp_ppl, int8_ppl, *_mb, *_ms_per_token, ratios)."""
    return [
        {"model": "FP32", "perplexity": m["fp_ppl"], "size_mb": m["fp32_mb"],
         "size_vs_bf16": m["fp32_mb"] / m["bf16_mb"], "ms_per_token": m["fp32_ms_per_token"], "latency_vs_fp32": 1.0},
        {"model": "BF16 (reference)", "perplexity": None, "size_mb": m["bf16_mb"], "size_vs_bf16": 1.0,
         "ms_per_token": m["bf16_ms_per_token"], "latency_vs_fp32": m["bf16_ms_per_token"] / m["fp32_ms_per_token"]},
        {"model": f"INT8 ({m['method']}, {m['backend']})", "perplexity": m["int8_ppl"], "size_mb": m["int8_mb"],
         "size_vs_bf16": m["size_ratio_vs_bf16"], "ms_per_token": m["int8_ms_per_token"],
         "latency_vs_fp32": m["latency_ratio_vs_fp32"]},
    ]


def markdown(rows: list[dict], m: dict, generations: list[dict]) -> str:
    def cell(v):
        return "—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    lines += ["", f"Perplexity drop: {m['ppl_drop_pct']:.3f}% (gate ≤ {m['max_drop_pct']}%) over {m['eval_tokens']} "
                  f"validation tokens; latency on {m['device']} over {m['latency_tokens']} tokens."]
    if generations:
        lines += ["", "## Greedy generations", ""]
        for g in generations:
            lines += [f"**prompt** `{g['prompt']!r}`", "", f"- FP32: `{g['fp']!r}`", f"- INT8: `{g['int8']!r}`", ""]
    return "\n".join(lines) + "\n"


def figure(m: dict):
    from matplotlib.figure import Figure  # not pyplot: no global figure registry, no GUI backend

    fig = Figure(figsize=(11, 3.2))
    axes = fig.subplots(1, 3)
    panels = [("perplexity", ["FP32", "INT8"], [m["fp_ppl"], m["int8_ppl"]]),
              ("size on disk (MB)", ["FP32", "BF16", "INT8"], [m["fp32_mb"], m["bf16_mb"], m["int8_mb"]]),
              (f"forward ms/token ({m['device']})", ["FP32", "BF16", "INT8"],
               [m["fp32_ms_per_token"], m["bf16_ms_per_token"], m["int8_ms_per_token"]])]
    for ax, (title, labels, values) in zip(axes, panels):
        bars = ax.bar(labels, values, color=[COLORS[label] for label in labels])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(title)
    fig.suptitle(f"INT8 {m['method']} ({m['backend']}) vs full precision: drop {m['ppl_drop_pct']:.2f}%")
    fig.tight_layout()
    return fig
