"""The ranked plan table (what `python -m tasks plan` prints and the stage logs as plan_table.txt)."""

from __future__ import annotations

from tasks.units import GB, MB

_HEAD = (
    f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'zero':>4} {'recompute':<9} {'schedule':<15} {'mb×m':>7} "
    f"{'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'other':>6} {'total':>7} {'step s':>9} "
    f"{'tok/s':>9} {'bubble':>6}"
)


# What the 'other' column holds: memory.stage_breakdown's buffers_bytes (transient whole tensors, each counted only
# where it applies) + the runtime reserve.
OTHER = (
    "'other' = transient buffers (ZeRO-3's gathered layers; under ZeRO 2/3 FSDP's root unit: embedding/output "
    "gradient whole until the reduce-scatter; under TP an untied embedding's whole-vocabulary gradients; a tied "
    "embedding's second gradient) + runtime reserve"
)


def plan_line(i, p: dict, unit: float = GB) -> str:
    other = p["buffers_bytes"] + p["reserve_bytes"]
    mem = " ".join(
        f"{x / unit:7.2f}" for x in (p["params_bytes"], p["grads_bytes"], p["optimizer_bytes"], p["activations_bytes"])
    )
    return (
        f"{i:>3} {p['dp']:>4} {p['tp']:>3} {p['pp']:>3} {p['zero']:>4} {p['recompute']:<9} "
        f"{p['pp_schedule']:<15} {str(p['micro_batch']) + '×' + str(p['microbatches']):>7} "
        f"{mem} {other / unit:6.2f} {p['total_bytes'] / unit:7.2f} {p['step_s']:9.3g} "
        f"{p['tokens_per_s']:9.3g} {p['bubble']:6.1%}"
    )


def _layout_name(r: dict) -> str:
    keys = [
        ("dp", "dp"),
        ("tp", "tp"),
        ("pp", "pp"),
        ("zero", "zero"),
        ("recompute", "recompute "),
        ("pp_schedule", ""),
        ("micro_batch", "mb "),
    ]
    return " ".join(f"{label}{r[k]}" for k, label in keys if k in r and r[k] != "none")


def render(result: dict, header: str, top_k: int = 10, rejected_k: int = 10, pinned: dict | None = None) -> str:
    """Header, the top_k feasible plans, then why the rest were rejected (each distinct structural reason once,
    the memory rejections closest to fitting first). `pinned`: the search result of a layout the config pins,
    shown first."""
    plans, rejected = result["plans"], result["rejected"]
    small = max((p["total_bytes"] for p in plans), default=GB) < GB  # a demo model reads better in MB
    unit, name = (MB, "MB") if small else (GB, "GB")
    lines = [header, ""]
    if pinned is not None:
        mine = (pinned["plans"] or pinned["rejected"] or [None])[0]
        lines += [
            "pinned by the config (parallel.dp/tp/pp): "
            + ("no layout" if mine is None else mine.get("reason", "fits")),
            _HEAD,
        ]
        lines += [plan_line("pin", mine, unit)] if mine and "total_bytes" in mine else []
        lines += ["", "alternatives:"]
    lines += [
        f"feasible plans: {len(plans)} (memory in {name} = 1e{6 if small else 9} bytes per device; "
        f"{OTHER}; step s assumes no compute/communication overlap)"
    ]
    lines += [_HEAD] if plans else []
    lines += [plan_line(i, p, unit) for i, p in enumerate(plans[:top_k], 1)]
    if len(plans) > top_k:
        lines.append(f"    … {len(plans) - top_k} more in plan.json")
    lines += rejected_lines(rejected, lambda r: f"{_layout_name(r):<58} {r['reason']}", rejected_k)
    return "\n".join(lines)


def rejected_lines(rejected: list[dict], line, k: int = 10) -> list[str]:
    """The printed rejections, one rule for the dense and the mixture-of-experts table: the count, each distinct
    structural reason once and the `k` memory rejections closest to fitting (`rejected` sorted so), each as
    `line(r)`, then how many more plan.json holds."""
    by_memory = [r for r in rejected if "total_bytes" in r]  # closest to fitting first
    structural = {}
    for r in rejected:
        if "total_bytes" not in r:
            structural.setdefault(r["reason"], r)  # each distinct reason once
    shown = list(structural.values())[:k] + by_memory[:k]
    lines = ["", f"rejected: {len(rejected)}"] + [f"  {line(r)}" for r in shown]
    if len(rejected) > len(shown):
        lines.append(f"  … {len(rejected) - len(shown)} more in plan.json")
    return lines
