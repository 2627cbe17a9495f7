"""The FP-vs-INT8 comparison as a table (JSON rows + markdown) and a figure, for MLflow and for a human; the per-task
table (FP32 / BF16 or FP16 / INT8 / champion) for the registered version's description.

The 16-bit model is named by its dtype everywhere (m["half"]: quantize.dtype, BF16 when that is fp32); the figure
keys `bf16_*` / `*_vs_bf16` keep their names (they are stable metric names) and hold the FP16 model's figures then.

`stages` is evaluate's metric dicts of the INT8 models measured (the one quantize handed on)."""

from __future__ import annotations

COLORS = {"FP32": "#4c72b0", "BF16": "#8c8c8c", "FP16": "#8172b3", "INT8 PTQ": "#dd8452", "INT8 QAT": "#55a868"}


def half_label(m: dict) -> str:
    """ "BF16" or "FP16": the 16-bit model measured beside FP32 and INT8 (its size and speed, the reference unless
    quantize.dtype is fp32)."""
    return m.get("half", "bf16").upper()


def _label(m: dict) -> str:
    return f"INT8 {m['stage'].upper()} ({m['method']}, {m['backend']})"


def comparison_rows(stages: list[dict]) -> list[dict]:
    m = stages[0]
    half = half_label(m)
    ref_is_half = m["reference"] == m.get("half", "bf16")  # the 16-bit model is the reference (not FP32)
    rows = [
        {
            "model": "FP32",
            "task_accuracy": m["fp_task_macro"],
            "perplexity": m["fp_ppl"],
            "top1_accuracy": m["fp_accuracy"],
            "greedy_agreement": None,
            "size_mb": m["fp32_mb"],
            "prefill_tok_s": m["fp32_prefill_tokens_per_s"],
            "decode_tok_s": m["fp32_decode_tokens_per_s"],
            "gate_value_pct": None,
        },
        {
            "model": f"{half} (reference)" if ref_is_half else half,
            "task_accuracy": m["ref_task_macro"] if ref_is_half else None,
            "perplexity": m["ref_ppl"] if ref_is_half else None,
            "top1_accuracy": m["ref_accuracy"] if ref_is_half else None,
            "greedy_agreement": 1.0 if ref_is_half else None,
            "size_mb": m["bf16_mb"],
            "prefill_tok_s": m["bf16_prefill_tokens_per_s"],
            "decode_tok_s": m["bf16_decode_tokens_per_s"],
            "gate_value_pct": None,
        },
    ]
    for s in stages:
        rows.append(
            {
                "model": _label(s),
                "task_accuracy": s["int8_task_macro"],
                "perplexity": s["int8_ppl"],
                "top1_accuracy": s["int8_accuracy"],
                "greedy_agreement": s.get("greedy_agreement"),
                "size_mb": s["int8_mb"],
                "prefill_tok_s": s["int8_prefill_tokens_per_s"],
                "decode_tok_s": s["int8_decode_tokens_per_s"],
                "gate_value_pct": s["gate_value"],
            }
        )
    return rows


def _cell(v):
    return "—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(cols: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(_cell(v) for v in r) + " |" for r in rows
    ]


def task_lines(tasks: dict) -> list[str]:
    """The per-task table: one row per evaluate.tasks entry, a column per model measured."""
    models = [m for m in ("fp32", "bf16", "fp16", "int8", "champion") if any(m in r for r in tasks.values())]
    cols = ["task", "metric", "examples", "shots"] + [m.upper() if m != "champion" else "champion" for m in models]
    rows = [[r["name"], r["metric"], r["n"], r.get("shots")] + [r.get(m) for m in models] for r in tasks.values()]
    return _table(cols, rows)


def markdown(rows: list[dict], stages: list[dict], generations: list[dict], split: dict, tasks: dict) -> str:
    cols = list(rows[0])
    lines = _table(cols, [[r[c] for c in cols] for r in rows])
    m = stages[0]
    lines += ["", "## Tasks (lm-evaluation-harness)", "", *task_lines(tasks)]
    lines += [
        "",
        f"Gate: `{m['gate_metric']}` ≤ {m['max_drop_pct']}%, INT8 against the unquantized model in "
        f"{m['reference'].upper()}{' (task scores measured by quantize, reused)' if m['task_scores_reused'] else ''}.",
    ]
    for s in stages:
        verdict = "passed" if s["passed"] else "missed"
        agree = f", greedy disagreement {s['greedy_disagreement_pct']:.2f}%" if "greedy_disagreement_pct" in s else ""
        lines.append(
            f"- {s['stage'].upper()}: {verdict} — macro task accuracy drop {s['task_accuracy_drop_pct']:.3f}%; "
            f"next-token accuracy drop {s['accuracy_drop_pct']:.3f}%, perplexity rise {s['ppl_drop_pct']:.3f}%{agree}."
        )
    lines += [
        "",
        f"Evaluation data: {m['eval_tokens']} tokens in {split['sequences']} sequences; {split['rule']}.",
        f"Speed on {m['device']}: batch 1, prompt {m['latency_prompt_tokens']} tokens, "
        f"{m['latency_new_tokens']} new tokens with a KV cache.",
    ]
    half = half_label(m)
    for what in ("decode", "prefill"):
        r = stages[-1][f"{what}_speed_vs_bf16"]
        lines.append(
            f"- {what}: INT8 {r:.2f}x {half} speed, {stages[-1][f'{what}_speed_vs_fp32']:.2f}x FP32"
            + (f" — INT8 is slower than {half} here" if r < 1 else "")
        )
    if generations:
        lines += ["", "## Greedy generations", ""]
        for g in generations:
            lines += [
                f"**prompt** `{g['prompt']!r}`",
                "",
                f"- {m['reference'].upper()}: `{g['fp']!r}`",
                f"- INT8: `{g['int8']!r}`",
                "",
            ]
    return "\n".join(lines) + "\n"


CARD = {
    "data": "Data",
    "tokenizer": "Tokenizer",
    "layout": "Parallel layout",
    "steps": "Training steps",
    "dag": "DAG run",
    "train_run": "Training run (MLflow)",
    "evaluate_run": "Evaluation run (MLflow)",
}


def description(tasks: dict, m: dict, champion: dict | None, reason: str, card: dict | None = None) -> str:
    """The registered version's description, a model card: the gate, the per-task table, the champion comparison,
    then data, tokenizer, training and lineage (`card`, keys of CARD)."""
    ref = m["reference"].upper()
    macro = (
        f"macro task accuracy FP32 {m['fp_task_macro']:.4f}, {ref} {m['ref_task_macro']:.4f}, INT8 "
        f"{m['int8_task_macro']:.4f}."
    )
    if m.get("passed", True):
        head = (
            f"INT8 {m['method']} ({m['backend']}, {m['stage'].upper()}): `{m['gate_metric']}` "
            f"{m['gate_value']:+.2f}% (gate ≤ {m['max_drop_pct']:g}%) against {ref}; {macro}"
        )
    else:  # a re-evaluation of registered weights missed: the card says so first, never the earlier pass
        head = (
            f"GATE MISSED in the newest evaluation: INT8 {m['method']} ({m['backend']}, {m['stage'].upper()}) "
            f"`{m['gate_metric']}` {m['gate_value']:+.2f}% exceeds the gate (≤ {m['max_drop_pct']:g}%) against "
            f"{ref} (tag eval.gate_passed=false; aliases left as they were); {macro}"
        )
    lines = [
        head,
        "",
        *task_lines(tasks),
        "",
        f"Champion: {reason}." if champion or reason else "",
        f"Supplementary (val tokens): perplexity {m['ref_ppl']:.4f} → {m['int8_ppl']:.4f}, next-token top-1 "
        f"{m['ref_accuracy']:.4f} → {m['int8_accuracy']:.4f}; size {m['size_ratio_vs_bf16']:.2f}x {half_label(m)}.",
    ]
    if card:
        lines += ["", "## Model card", "", *_table(["", ""], [[CARD[k], card[k]] for k in CARD if k in card])]
    return "\n".join(lines) + "\n"


def bf16_description(int8_description: str, half: str = "bf16") -> str:
    """The BF16 (FP16) version's description: what it is, then the INT8 version's model card (same data, same
    lineage)."""
    return (
        f"{half.upper()}: the unquantized model (the train stage's HF export, `extra_files/`: config.json, "
        "safetensors, tokenizer) that the INT8 version below was quantized from and gated against.\n\n"
        + int8_description
    )


def figure(stages: list[dict]):
    from matplotlib.figure import Figure  # not pyplot: no global figure registry, no GUI backend

    m = stages[0]
    ints = [f"INT8 {s['stage'].upper()}" for s in stages]
    pair = ["FP32", half_label(m)]
    fig = Figure(figsize=(17, 3.2))
    axes = fig.subplots(1, 5)
    panels = [
        (
            "task accuracy (macro)",
            pair + ints,
            [m["fp_task_macro"], m["ref_task_macro"]] + [s["int8_task_macro"] for s in stages],
        ),
        (
            "next-token top-1 accuracy",
            pair + ints,
            [m["fp_accuracy"], m["ref_accuracy"]] + [s["int8_accuracy"] for s in stages],
        ),
        ("perplexity", pair + ints, [m["fp_ppl"], m["ref_ppl"]] + [s["int8_ppl"] for s in stages]),
        ("size on disk (MB)", pair + ints, [m["fp32_mb"], m["bf16_mb"]] + [s["int8_mb"] for s in stages]),
        (
            f"decode tokens/s, batch 1 ({m['device']})",
            pair + ints,
            [m["fp32_decode_tokens_per_s"], m["bf16_decode_tokens_per_s"]]
            + [s["int8_decode_tokens_per_s"] for s in stages],
        ),
    ]
    for ax, (title, labels, values) in zip(axes, panels):
        bars = ax.bar(labels, values, color=[COLORS[label] for label in labels])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_title(title)
    s = stages[-1]
    fig.suptitle(
        f"INT8 {s['method']} ({s['backend']}) vs {m['reference'].upper()}: {s['gate_metric']} "
        f"{s['gate_value']:.2f}% ({'passed' if s['passed'] else 'missed'} by {s['stage'].upper()})"
    )
    fig.tight_layout()
    return fig
