"""Compare a report with the last successful profile of the same MLflow experiment (the tuning loop's baseline).

A run counts as a baseline when it is a finished `profile` stage run whose result status was ok/warn and whose
profile came from the same kind of source (a CPU trace is no baseline for an Ascend cluster).
"""
from __future__ import annotations

from tasks import tracking
from tasks.config import PipelineConfig

STEP_KEY = "profile.step_ms"
COMM_KEY = "profile.comm_not_overlapped_share"
FORMAT_TAG = "profile.format"
MIN_COMM_DELTA = 0.01   # a share moving by less than one point is noise, whatever its relative change


def report_metrics(report: dict) -> dict[str, float]:
    s = report["step"]
    return {STEP_KEY: s["step_us"] / 1000, COMM_KEY: s["shares"]["comm_not_overlapped"],
            "profile.computing_share": s["shares"]["computing"], "profile.free_share": s["shares"]["free"],
            "profile.bubble_share": s["shares"]["bubble"], "profile.allreduce_share": s["allreduce_share"],
            "profile.world": report["world"]}


def find_baseline(cfg: PipelineConfig, fmt: str, exclude_run_id: str | None) -> dict | None:
    """{"run_id", "metrics"} of the newest matching run, or None (tracking off, first profile, …)."""
    if not cfg.tracking.enabled:
        return None
    import mlflow

    client = mlflow.MlflowClient(tracking.tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], "tags.`pipeline.stage` = 'profile' and attributes.status = "
                              "'FINISHED'", order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        if run.info.run_id == exclude_run_id or tags.get("pipeline.status") not in ("ok", "warn"):
            continue
        if tags.get(FORMAT_TAG) == fmt and STEP_KEY in metrics and COMM_KEY in metrics:
            return {"run_id": run.info.run_id, "metrics": {STEP_KEY: metrics[STEP_KEY], COMM_KEY: metrics[COMM_KEY]}}
    return None


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
            findings.append({
                "rule": "baseline.regression", "severity": "high",
                "title": f"{label} regressed {change:+.0%} against the baseline run {baseline['run_id'][:8]}",
                "evidence": {"metric": key, "baseline": old, "current": new, "change": change,
                             "threshold": threshold, "baseline_run_id": baseline["run_id"]},
                "advice": "Compare the two reports' top operators and step breakdown; revert or re-plan the change "
                          "since the baseline (parallel plan, micro-batch, code)."})
    return {"run_id": baseline["run_id"], "threshold": threshold, "metrics": rows}, findings
