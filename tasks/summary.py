"""The one-screen end-of-run summary: stage, status, key figure, MLflow run link."""

from __future__ import annotations

import argparse
from pathlib import Path

from tasks.config import load_config
from tasks.errors import StageError
from tasks.runner import load_inputs
from tasks.stages import STAGES, TITLES
from tasks.tracking import run_url

APPROVAL_FILE = "approval.json"  # <run-dir>/approval.json: the approve task's outcome (tasks.pipeline writes it)


def render(run_dir, cfg=None, experiment_id: str | None = None) -> str:
    """The table; MLflow links on tracking.ui_url() of `cfg` (None: $MLFLOW_UI_URL or the default)."""
    results = load_inputs(run_dir)
    lines = [f"{'stage':<28} {'status':<8} {'secs':>7}  key figure", "-" * 100]
    for stage in STAGES:
        r = results.get(stage)
        if r is None:
            lines.append(f"{TITLES[stage]:<28} {'-':<8} {'':>7}  (not run)")
            continue
        lines.append(
            f"{TITLES[stage]:<28} {r.get('status', '?'):<8} {r.get('seconds', 0):>7.1f}  "
            f"{str(r.get('summary', ''))[:80]}"
        )
        if r.get("summary_detail"):  # a second figure line (evaluate: task accuracy per model)
            lines.append(f"{'':<46}{str(r['summary_detail'])[:80]}")
        if r.get("mlflow_run_id"):
            exp = r.get("mlflow_experiment_id") or experiment_id
            lines.append(f"{'':<46}MLflow: {run_url(r['mlflow_run_id'], cfg, exp)}")
    lines += model_lines(results.get("evaluate") or {}, run_dir)
    return "\n".join(lines)


def model_lines(evaluate: dict, run_dir) -> list[str]:
    """The registered version, why it is or is not the champion, and the approval: each reason in full (the
    table's key figure is cut at 80 characters)."""
    from pathlib import Path

    from tasks.fsutil import read_json

    if not evaluate.get("version"):
        return []
    name, version = evaluate.get("registered_model", "?"), evaluate["version"]
    path = Path(run_dir) / APPROVAL_FILE
    answer = read_json(path) if path.is_file() else None
    approved = (answer or {}).get("outcome") == "approved"
    role = "the champion" if evaluate.get("champion") or approved else "a candidate, not the champion"
    if not evaluate.get("aliases_moved", True) and role != "the champion":
        role = "registered, no alias moved"
    out = ["", f"Model: {name} v{version} is {role} ({evaluate.get('champion_reason', '')})"]
    approval = evaluate.get("approval") or {}
    if approval.get("needed") or answer:
        reason = approval.get("reason") or (answer or {}).get("reason", "")
        if answer is None:
            outcome = "waiting for a person (Airflow: Browse → Required actions), or not answered"
        elif answer["outcome"] == "approved":
            outcome = f"approved by {answer['by']}: v{answer['version']} is the champion"
        else:
            outcome = f"rejected by {answer['by']}: the champion is unchanged"
        out.append(f"Approval: {reason} → {outcome}")
    return out


def main(argv=None, run_config=None) -> int:
    """`run_config(run_dir, config)` → (preset, overrides): the run directory's config as its stages took it
    (tasks.cli passes its dag_run_config; this module does not import the CLI, which imports it)."""
    p = argparse.ArgumentParser(prog="python -m tasks summary")
    p.add_argument("--run-dir", required=True, help="the run directory whose <stage>.json files are summarised")
    p.add_argument("--config", default=None, help="preset or YAML whose tracking settings build the MLflow links")
    p.add_argument("--check", action="store_true", help="exit 1 unless every stage finished ok or warn")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not args.run_dir.strip() or not run_dir.is_dir():
        raise StageError(f"summary: --run-dir {args.run_dir!r} is not a directory (no run there); check the path")
    cfg = load_config(*run_config(args.run_dir, args.config)) if run_config else load_config(args.config)
    print(render(args.run_dir, cfg))
    if args.check:
        results = load_inputs(args.run_dir)
        return 0 if all(results.get(s, {}).get("status") in ("ok", "warn") for s in STAGES) else 1
    return 0
