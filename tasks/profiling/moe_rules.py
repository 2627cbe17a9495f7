"""Mixture-of-experts rule: expert load imbalance, from the router statistics the trainer logs per step
(metrics.jsonl: moe_tokens_per_expert {layer: [tokens per expert]}, moe_load_max_over_mean; tasks/train/trainer.py).

An expert that receives far more than the mean number of tokens sets the pace of its layer (dropless: its grouped
matmul is the longest; with expert parallelism its rank's all-to-all and compute are the longest — the other ranks
wait). Fires when the busiest expert's tokens over the mean exceed `max_over_mean` (default 1.5, the capacity
factor commonly used to bound dropping, e.g. GShard / Switch Transformer's 1.25–2.0 range) in any layer, averaged
over the logged steps — the profiler's active (recorded) steps only when the stage passes them
(tasks.profiling.collect.active_steps), as every other figure of the profile: the skipped and warm-up steps' routing
is left out. All-to-all itself is counted as communication by tasks.profiling.model.categorize.
"""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path

MAX_OVER_MEAN = 1.5


def expert_load(
    metrics_path: str | Path, max_over_mean: float = MAX_OVER_MEAN, steps: Container[int] | None = None
) -> dict | None:
    """What the rule evaluated: per layer the busiest expert's tokens over the mean, summed over the logged steps
    of the run's router statistics (only those whose `step` is in `steps` when given: the profiler's active steps);
    None for a run without them (a dense model)."""
    path = Path(metrics_path)
    if not path.is_file():
        return None
    records = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = [r for r in records if r.get("moe_tokens_per_expert") and (steps is None or r.get("step") in steps)]
    if not records:
        return None
    by_layer: dict[str, list[float]] = {}
    for r in records:
        for layer, tokens in r["moe_tokens_per_expert"].items():
            acc = by_layer.setdefault(layer, [0.0] * len(tokens))
            for i, t in enumerate(tokens):
                acc[i] += t
    ratios = {layer: max(t) / (sum(t) / len(t)) for layer, t in by_layer.items() if sum(t) > 0}
    worst = max(ratios, key=ratios.get) if ratios else None
    return {
        "steps": len(records),
        "threshold": max_over_mean,
        "by_layer_max_over_mean": ratios,
        "worst_layer": worst,
        "max_over_mean": ratios[worst] if worst else 0.0,
        "tokens_per_expert": by_layer,
    }


def expert_imbalance(
    metrics_path: str | Path, max_over_mean: float = MAX_OVER_MEAN, steps: Container[int] | None = None
) -> list[dict]:
    load = expert_load(metrics_path, max_over_mean, steps)
    if not load or load["worst_layer"] is None or load["max_over_mean"] <= max_over_mean:
        return []
    worst, ratio = load["worst_layer"], load["max_over_mean"]
    tokens = load["tokens_per_expert"][worst]
    busiest = max(range(len(tokens)), key=tokens.__getitem__)
    return [
        {
            "rule": "moe.expert_imbalance",
            "severity": "high" if ratio >= 2 * max_over_mean else "medium",
            "title": f"expert {busiest} of layer {worst} gets {ratio:.2f}× the mean tokens "
            f"(threshold {max_over_mean:g}×)",
            "evidence": {
                "layer": worst,
                "expert": busiest,
                "max_over_mean": ratio,
                "steps": load["steps"],
                "by_layer_max_over_mean": load["by_layer_max_over_mean"],
                "tokens_per_expert": tokens,
            },
            "advice": "Raise model.aux_loss_coef (load-balancing loss), or cap the busiest experts with "
            "model.capacity_factor; with expert parallelism the rank owning that expert sets the pace of the "
            "all-to-all.",
        }
    ]
