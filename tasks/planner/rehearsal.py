"""The rehearsal's judgement (issue 24 item 3; the trainer runs it): the first steps of the real model on the planned
layout against the plan's estimate, and, when they disagree, the next feasible plan — in one line.

Pure: figures in, a verdict out. The train stage's launcher puts `spec()` in the launch spec (the plan's estimate
for the layout it runs, the device's capacity, the planner's ranked alternatives); the trainer measures each rank's
peak memory and the step time over `steps` rehearsal steps and calls `verdict()`; a failed verdict stops the run
with `verdict()["cause"]` before hours of cluster time are spent on a layout that will run out of memory or run far
slower than planned. Measured and estimated figures go to MLflow as `rehearsal.*` (`figures()`).
"""

from __future__ import annotations

from tasks.units import GB, MB

LAYOUT_KEYS = ("dp", "tp", "pp", "ep", "zero", "recompute", "micro_batch", "microbatches", "pp_schedule")
ALTERNATIVES = 20  # ranked plans carried in the spec: enough to find one that fits at the measured ratio


def layout_name(p: dict) -> str:
    ep = f"·ep{p['ep']}" if p.get("ep", 1) > 1 else ""
    sched = f" {p['pp_schedule']}" if p.get("pp", 1) > 1 else ""
    return (
        f"dp{p['dp']}{ep} tp{p['tp']} pp{p['pp']} zero{p['zero']} {p['recompute']} "
        f"mb{p['micro_batch']}×{p['microbatches']}{sched}"
    )


def pins(p: dict) -> str:
    """The --set flags that pin plan `p` (the planner then verifies it instead of searching)."""
    keys = ["dp", "tp", "pp", "zero", "recompute"] + (["ep"] if p.get("ep", 1) > 1 else [])
    # a pinned layout keeps the config's schedule (tasks/stages/plan.problem): name the plan's under PP
    keys += ["pp_schedule"] if p.get("pp", 1) > 1 and p.get("pp_schedule") else []
    # interleaved 1F1B's chunks per rank are the plan's too (a config's other parallel.virtual_stages is another run)
    keys += (
        ["virtual_stages"]
        if "pp_schedule" in keys and p["pp_schedule"] == "interleaved1f1b" and "virtual_stages" in p
        else []
    )
    sets = [f"parallel.{k}={p[k]}" for k in keys] + [f"train.micro_batch={p['micro_batch']}"]
    return " ".join(f"--set {s}" for s in sets)


def spec(
    plan_doc: dict,
    estimate_bytes: float,
    capacity_bytes: float,
    steps: int,
    tolerance: float,
    judge_step_time: bool = True,
    tolerance_key: str = "plan.tolerance",
) -> dict:
    """The launch spec's `rehearsal` entry: what the trainer needs to judge the first `steps` steps.
    `estimate_bytes`: the planner's per-rank peak for the layout being run (as the train stage computes it);
    `capacity_bytes`: what a rank may allocate (device memory, less the runtime reserve the allocator never sees);
    `judge_step_time` False: the step time is measured and reported, not judged (a CPU host, docs/real-size.md);
    `tolerance_key`: the setting `tolerance` came from, named in the cause."""
    chosen = plan_doc.get("chosen") or {}
    ranked = plan_doc.get("plans") or []
    return {
        "steps": steps,
        "tolerance": tolerance,
        "tolerance_key": tolerance_key,
        "estimate_bytes": float(estimate_bytes),
        "estimate_step_s": float(chosen.get("step_s") or 0.0),
        "judge_step_time": judge_step_time,
        "capacity_bytes": float(capacity_bytes),
        "chosen": {k: chosen[k] for k in LAYOUT_KEYS if k in chosen},
        "alternatives": [
            {**{k: p[k] for k in LAYOUT_KEYS if k in p}, "total_bytes": p["total_bytes"], "step_s": p["step_s"]}
            for p in ranked[:ALTERNATIVES]
        ],
    }


def layout_identity(p: dict) -> tuple:
    """What `pins()` would pin: two layouts with the same pins are the same run. The schedule counts only under PP (the
    planner writes `none` at pp 1, the run keeps its config's `parallel.pp_schedule`, which pp 1 ignores)."""
    pp = p.get("pp", 1)
    return (
        *(p.get(k) for k in ("dp", "tp", "zero", "recompute", "micro_batch")),
        pp,
        p.get("ep") or 1,
        p.get("pp_schedule") if pp > 1 else None,
    )


def next_plan(sp: dict, memory_ratio: float) -> dict | None:
    """The best-ranked alternative other than the layout being run whose estimate, scaled by how far the measured
    peak exceeded the estimate (`memory_ratio`, at least 1), still fits the capacity."""
    k = max(1.0, memory_ratio)
    same = layout_identity(sp["chosen"])
    for p in sp["alternatives"]:
        if layout_identity(p) == same:
            continue
        if p["total_bytes"] * k <= sp["capacity_bytes"]:
            return p
    return None


def sizes(*values: float) -> list[str]:
    """Byte figures compared in one line, in one unit (MB when all are under 1 GB), with enough decimals that
    different figures read differently (0.128 GB against a 0.131 GB peak is not "0.13 GB over 0.13 GB")."""
    unit, div, digits = ("MB", MB, 1) if max(values) < GB else ("GB", GB, 2)
    for d in range(digits, digits + 7):
        texts = [f"{v / div:.{d}f}" for v in values]
        if all(a != b for i, a in enumerate(texts) for j, b in enumerate(texts) if values[i] != values[j]):
            break
    return [f"{t} {unit}" for t in texts]


def verdict(sp: dict, peaks: list[float], step_s: float, held: list[float] | None = None) -> dict:
    """`peaks`: each rank's measured peak bytes over the rehearsal; `step_s`: the measured step time (the first step,
    which pays for allocation and kernel selection, left out); `held`: what each rank's peak is compared with the
    estimate as (default `peaks`; on CPU the RSS peak less what the process held before the model existed, like
    tasks.stages.train.memory_figures). Stops (`ok` False, `cause` one line) when a rank's peak exceeds the capacity,
    or what it held exceeds the estimate by more than the tolerance, or (where judged) steps run slower than the
    estimate by more than the tolerance."""
    held = list(peaks) if held is None else held
    top, most = max(peaks), max(held)
    est, cap, tol = sp["estimate_bytes"], sp["capacity_bytes"], sp["tolerance"]
    key = sp.get("tolerance_key", "plan.tolerance")
    est_s = sp["estimate_step_s"] if sp.get("judge_step_time", True) else 0.0
    ratio = most / est if est else 1.0  # measured over estimated: what the alternatives are scaled by
    out = {
        "peak_bytes": top,
        "held_bytes": most,
        "peak_rank": peaks.index(top) if top > cap else held.index(most),
        "estimate_bytes": est,
        "estimate_over_measured": est / most if most else 0.0,
        "step_s": step_s,
        "estimate_step_s": sp["estimate_step_s"],
        "step_estimate_over_measured": sp["estimate_step_s"] / step_s if step_s and sp["estimate_step_s"] else 0.0,
        "ok": True,
        "cause": None,
    }
    rank, what = out["peak_rank"], None
    if top > cap:
        top_t, cap_t, est_t = sizes(top, cap, est)
        what = f"rank {rank} peaked at {top_t}, over the {cap_t} a device holds (the plan's estimate {est_t})"
    elif most > est * (1 + tol):
        most_t, est_t = sizes(most, est)
        what = (
            f"rank {rank} peaked at {most_t} against the plan's {est_t} estimate "
            f"(+{ratio - 1:.0%}, beyond {key} {tol:.0%})"
        )
    elif est_s and step_s > est_s * (1 + tol):
        what = (
            f"steps take {step_s:.3g} s against the plan's {est_s:.3g} s estimate (+{step_s / est_s - 1:.0%}, beyond "
            f"{key} {tol:.0%}; the step-time model is off: lower plan.efficiency and re-plan)"
        )
    if what is None:
        return out
    alt = next_plan(sp, ratio)
    if alt is None:
        then = "no other planned layout fits at the measured ratio: lower train.micro_batch or add devices"
    else:
        scaled = alt["total_bytes"] * max(1.0, ratio)
        then = f"next feasible plan {layout_name(alt)} (~{scaled / GB:.1f} GB at the measured ratio): {pins(alt)}"
    out.update(ok=False, cause=f"rehearsal at {layout_name(sp['chosen'])}: {what}; {then}")
    return out


def figures(v: dict) -> dict:
    """The MLflow metrics of a verdict."""
    return {
        "rehearsal.peak_gb": v["peak_bytes"] / GB,
        "rehearsal.held_gb": v["held_bytes"] / GB,
        "rehearsal.estimate_gb": v["estimate_bytes"] / GB,
        "rehearsal.estimate_over_measured": v["estimate_over_measured"],
        "rehearsal.step_s": v["step_s"],
        "rehearsal.step_estimate_over_measured": v["step_estimate_over_measured"],
        "rehearsal.ok": float(v["ok"]),
    }
