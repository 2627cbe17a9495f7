"""Compare a report with the last successful profile of the same MLflow experiment (the tuning loop's baseline).

A run counts as a baseline when it is a finished `profile` stage run whose result status was ok/warn and whose
profile has the same key: model shape, layout (dp/tp/pp/zero), world size, device kind (and trace format), seq_len,
micro-batch, global batch (micro-batches per step), precision, optimizer, torch.compile, model converters and NPU
kernels, the profiler's own options, and the analyzer whose step breakdown the report holds (builtin or
msprof-analyze: two engines on one identical trace differ, which is no regression). A profile of anything else is not
slower or faster, just different: with no run of the same key the report says "no baseline yet" (and what differs
from the newest profile), never a regression. Profiles logged before global batch, optimizer, compile, converters,
profiler options and analyzer joined the key have another key than any profile since: they are no baseline for a
newer one (its report says "no baseline yet").
"""

from __future__ import annotations

import hashlib
import json

from tasks import tracking
from tasks.config import PipelineConfig

STEP_KEY = "profile.step_ms"
COMM_KEY = "profile.comm_not_overlapped_share"
FORMAT_TAG = "profile.format"
KEY_TAG, KEY_JSON_TAG = "profile.key", "profile.key_json"
NPU_FORMATS = ("ascend_pt", "msprof", "cluster_analysis")


def profile_key(cfg: PipelineConfig, report: dict, device_kind: str | None = None, ran: dict | None = None) -> dict:
    """What makes two profiles comparable. `device_kind`: the backend the profiled run used (collect); for an
    analysed folder, Ascend formats mean npu and a torch trace counts as the configured hardware.device. `ran`: the
    collect's record (traces/collected.json) of the layout and model shape the profiled run used — the resolved
    ones (pinned, or the plan's: a preset leaving dp/tp/pp to the planner keyed every layout as dp 0 tp 0 pp 0, and
    two checkpoints of one preset as one model); without it (an analysed folder) the config's."""
    fmt = report["source"]["format"]
    ran = ran or {}
    model = ran.get("model") or {k: v for k, v in cfg.to_dict()["model"].items() if k != "hf_path"}
    p, lay = cfg.parallel, ran.get("layout") or {}
    device = device_kind or ("npu" if fmt in NPU_FORMATS else cfg.hardware.device)
    return {
        "model": model,
        "dp": lay.get("dp", p.dp),
        "tp": lay.get("tp", p.tp),
        "pp": lay.get("pp", p.pp),
        "zero": lay.get("zero", p.zero),
        **{k: lay[k] for k in ("ep", "recompute", "pp_schedule") if k in lay},
        "world": report["world"],
        "device": device,
        "format": fmt,
        "seq_len": cfg.data.seq_len,
        "micro_batch": lay.get("micro_batch", cfg.train.micro_batch),
        # the micro-batches per step (global batch / dp / micro-batch, or parallel.microbatches) set how often the
        # gradients are reduced per forward: a bigger global batch is another communication share, not a regression
        "global_batch": lay.get("global_batch", cfg.train.global_batch),
        "microbatches": lay.get("microbatches", cfg.parallel.microbatches),
        "precision": cfg.train.precision,
        "optimizer": cfg.train.optimizer,
        "compile": cfg.train.compile,
        "converters": list(cfg.model.converters),
        "npu_kernels": cfg.model.npu_kernels,
        "profiler": profiler_options(cfg, device),
        # the engine that gave the step breakdown (engine.apply, run before the key): report_metrics logs its figures
        "analyzer": (report.get("engine") or {}).get("used", "builtin"),
    }


def profiler_options(cfg: PipelineConfig, device: str) -> dict:
    """The profiler's own options that change what it costs (and so the step it measures): torch's record_shapes,
    profile_memory, with_stack; on NPU also torch_npu's level and AI Core metrics (ignored elsewhere)."""
    pc = cfg.profile
    out = {"record_shapes": pc.record_shapes, "profile_memory": pc.profile_memory, "with_stack": pc.with_stack}
    if device == "npu":
        out.update(npu_level=pc.npu_level, aic_metrics=pc.aic_metrics)
    return out


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _differences(old: dict, new: dict) -> str:
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old), flat(new)
    diffs = [f"{k} {a.get(k)!r}→{b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(diffs[:6]) + (" …" if len(diffs) > 6 else "")


MIN_COMM_DELTA = 0.01  # a share moving by less than one point is noise, whatever its relative change


def report_metrics(report: dict) -> dict[str, float]:
    s = report["step"]
    return {
        STEP_KEY: s["step_us"] / 1000,
        COMM_KEY: s["shares"]["comm_not_overlapped"],
        "profile.computing_share": s["shares"]["computing"],
        "profile.free_share": s["shares"]["free"],
        "profile.bubble_share": s["shares"]["bubble"],
        "profile.allreduce_share": s["allreduce_share"],
        "profile.all_to_all_share": s.get("all_to_all_share", 0.0),
        "profile.world": report["world"],
    }


def find_baseline(cfg: PipelineConfig, key: dict, exclude_run_id: str | None) -> tuple[dict | None, str]:
    """({"run_id", "metrics"} of the newest successful run with the same key, or None; a note saying which run is
    the baseline, or why there is none yet — tracking off, first profile, or only profiles of another key)."""
    if not cfg.tracking.enabled:
        return None, "no baseline: tracking is off"
    import mlflow

    client = mlflow.MlflowClient(tracking.tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None, "no baseline yet: first profile of this experiment"
    runs = client.search_runs(
        [exp.experiment_id],
        "tags.`pipeline.stage` = 'profile' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=200,
    )
    digest, other = key_digest(key), None
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        if run.info.run_id == exclude_run_id or tags.get("pipeline.status") not in ("ok", "warn"):
            continue
        if STEP_KEY not in metrics or COMM_KEY not in metrics:
            continue
        if tags.get(KEY_TAG) == digest:
            return (
                {"run_id": run.info.run_id, "metrics": {STEP_KEY: metrics[STEP_KEY], COMM_KEY: metrics[COMM_KEY]}},
                f"baseline: run {run.info.run_id} (same model shape, layout, world, device, seq_len, "
                "micro-batch, global batch, precision, optimizer, compile, converters, profiler options, analyzer)",
            )
        other = other or run
    if other is None:
        return None, "no baseline yet: first profile of this experiment"
    try:
        old_key = json.loads(other.data.tags.get(KEY_JSON_TAG, ""))
        why = _differences(old_key, key)
    except ValueError:
        why = "it predates profile keys"
    return None, (
        f"no baseline yet for this configuration: the newest profile (run {other.info.run_id[:8]}) "
        f"differs ({why}); profiles are compared only with the same key"
    )


def compare(report: dict, baseline: dict | None, threshold: float) -> tuple[dict | None, list[dict]]:
    """(comparison for the report, regression findings)."""
    if baseline is None:
        return None, []
    now = report_metrics(report)
    rows, findings = {}, []
    for key, label in ((STEP_KEY, "step time"), (COMM_KEY, "communication share")):
        old, new = baseline["metrics"][key], now[key]
        change = (new - old) / old if old > 0 else 0.0
        rows[key] = {"baseline": old, "current": new, "change": change}
        regressed = change > threshold and (key != COMM_KEY or new - old >= MIN_COMM_DELTA)
        if regressed:
            findings.append(
                {
                    "rule": "baseline.regression",
                    "severity": "high",
                    "title": f"{label} regressed {change:+.0%} against the baseline run {baseline['run_id'][:8]}",
                    "evidence": {
                        "metric": key,
                        "baseline": old,
                        "current": new,
                        "change": change,
                        "threshold": threshold,
                        "baseline_run_id": baseline["run_id"],
                    },
                    "advice": "Compare the two reports' top operators and step breakdown; revert or re-plan the change "
                    "since the baseline (parallel plan, micro-batch, code).",
                }
            )
    return {"run_id": baseline["run_id"], "threshold": threshold, "metrics": rows}, findings
