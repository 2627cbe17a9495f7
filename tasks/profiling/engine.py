"""Which engine gives the step breakdown of Ascend data (`profile.analyzer`):

- msprof-analyze: Huawei's own analysis (`msprof-analyze -m all -d DATA -o OUT`, PyPI package msprof-analyze,
  version matching the CANN that collected the data); its step trace becomes the report's step breakdown —
  cluster_step_trace_time.csv from a text export, or table ClusterStepTraceTime of cluster_analysis.db when the
  folders hold torch_npu's db export (CANN >= 8.5 writes ascend_pytorch_profiler_{rank}.db even with the text
  export, and msprof-analyze 26.2.0 then reads the db: cluster_data_preprocess/prof_data_allocate.py;
  tasks.profiling.ascend.read_cluster reads both). Required: a missing or failing tool fails the stage in one line.
- builtin: this project's readers only (tasks/profiling/ascend.py).
- auto (default): msprof-analyze when it is on PATH and succeeds, else builtin with the reason in the notes.
Where both ran, their mean step breakdowns are compared: every part (computing, communication not overlapped,
overlapped, free, bubble) must agree within 1 % of the step, else a medium finding `analysis.disagreement` names the
part. Operators, communication ops and memory always come from the built-in per-rank readers (msprof-analyze's
cluster output has no operator table).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.errors import StageError
from tasks.profiling.msprof import run_msprof_analyze

ASCEND_FORMATS = ("ascend_pt", "msprof")
PARTS = ("computing_us", "comm_not_overlapped_us", "overlapped_us", "free_us", "bubble_us")
AGREEMENT = 0.01


def compare_breakdowns(builtin: dict, primary: dict) -> dict:
    """{part: |builtin − primary| / primary step} and the worst part."""
    step = primary["step_us"] or 1.0
    diffs = {p.removesuffix("_us"): abs(builtin.get(p, 0.0) - primary.get(p, 0.0)) / step for p in PARTS}
    worst = max(diffs, key=diffs.get)
    return {
        "by_part": diffs,
        "worst_part": worst,
        "worst": diffs[worst],
        "within": diffs[worst] <= AGREEMENT,
        "step_us": {"builtin": builtin["step_us"], "msprof_analyze": primary["step_us"]},
    }


def apply(analyzer: str, report: dict, source: Path, out_dir: Path, run=run_msprof_analyze) -> dict:
    """Set report["engine"] (and, with msprof-analyze, its step breakdown as the report's, the rules then run again
    over it: `report` is analyze()'s, whose findings all come from the rules); returns the report."""
    from tasks.profiling.loader import load_profile
    from tasks.profiling.report import build_report
    from tasks.profiling.rules_guides import evaluate

    fmt = report["source"]["format"]
    eng = report["engine"] = {"requested": analyzer, "used": "builtin"}
    if analyzer == "builtin":
        eng["reason"] = "profile.analyzer is builtin"
        return report
    if fmt not in ASCEND_FORMATS:
        if analyzer == "msprof-analyze":
            raise StageError(
                f"profile.analyzer is msprof-analyze but {source} is {fmt} data, which msprof-analyze "
                "does not read; use profile.analyzer=auto or builtin"
            )
        eng["reason"] = f"{fmt} data: msprof-analyze reads Ascend profiles only"
        return report
    # out_dir is msprof-analyze's own folder: an earlier run's output left there (same run directory) would be read
    # as this run's when the tool writes nothing (exits 0, or fails before writing)
    shutil.rmtree(out_dir, ignore_errors=True)
    result = run(source, out_dir, fmt=fmt)
    report["source"]["msprof_analyze"] = result
    cluster = out_dir / "cluster_analysis_output"
    if result["status"] != "ok" or not cluster.is_dir():
        why = result.get("reason") or (
            f"msprof-analyze {result['status']} (see {out_dir})"
            if result["status"] != "ok"
            else f"msprof-analyze exited 0 but wrote no cluster_analysis_output in {out_dir}"
        )
        if analyzer == "msprof-analyze":  # the install hint only when the tool is missing (result["fix"])
            fix = f"fix: {result['fix']}, or set" if result.get("fix") else "or set"
            raise StageError(
                f"profile.analyzer is msprof-analyze but it did not run: {why}; {fix} "
                "profile.analyzer=auto to fall back to the built-in readers"
            )
        eng["reason"] = f"{why}; built-in readers used"
        report["source"]["notes"].append(f"msprof-analyze not used: {why}")
        return report
    primary = build_report(load_profile(cluster))
    agreement = compare_breakdowns(report["step"], primary["step"])
    eng.update(used="msprof-analyze", agreement=agreement, builtin_step=report["step"])
    report["step"] = {**report["step"], **{k: primary["step"][k] for k in ("step_us", *PARTS, "shares")}}
    # the rules judged the built-in breakdown (analyze): judge the one the report now shows
    report["findings"], report["info"] = evaluate(report)
    if not agreement["within"]:
        report["findings"].append(
            {
                "rule": "analysis.disagreement",
                "severity": "medium",
                "title": f"msprof-analyze and the built-in readers differ by {agreement['worst']:.1%} of the step in "
                f"{agreement['worst_part']}",
                "evidence": {k: round(v, 4) for k, v in agreement["by_part"].items()},
                "advice": "Check the msprof-analyze version against the CANN that collected the data, and that text "
                "and db exports do not coexist in the folder (msprof-analyze reads one format).",
            }
        )
    return report
