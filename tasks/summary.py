"""The one-screen end-of-run summary: stage, status, key figure, MLflow run link."""

from __future__ import annotations

import argparse
from pathlib import Path

from tasks.config import load_config
from tasks.errors import StageError
from tasks.runner import load_inputs
from tasks.stages import STAGES, TITLES
from tasks.tracking import run_url


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
            lines.append(f"{'':<46}MLflow: {run_url(r['mlflow_run_id'], cfg, experiment_id)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks summary")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--check", action="store_true", help="exit 1 unless every stage finished ok or warn")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not args.run_dir.strip() or not run_dir.is_dir():
        raise StageError(f"summary: --run-dir {args.run_dir!r} is not a directory (no run there); check the path")
    cfg = load_config(args.config)
    print(render(args.run_dir, cfg))
    if args.check:
        results = load_inputs(args.run_dir)
        return 0 if all(results.get(s, {}).get("status") in ("ok", "warn") for s in STAGES) else 1
    return 0
