"""The one-screen end-of-run summary: stage, status, key figure, MLflow run link."""
from __future__ import annotations

import argparse

from tasks.config import load_config
from tasks.runner import load_inputs
from tasks.stages import STAGES, TITLES


def render(run_dir, ui_url: str = "http://127.0.0.1:5000", experiment_id: str | None = None) -> str:
    results = load_inputs(run_dir)
    lines = [f"{'stage':<28} {'status':<8} {'secs':>7}  key figure", "-" * 100]
    for stage in STAGES:
        r = results.get(stage)
        if r is None:
            lines.append(f"{TITLES[stage]:<28} {'-':<8} {'':>7}  (not run)")
            continue
        lines.append(f"{TITLES[stage]:<28} {r.get('status', '?'):<8} {r.get('seconds', 0):>7.1f}  "
                     f"{str(r.get('summary', ''))[:80]}")
        if r.get("mlflow_run_id"):
            exp = f"experiments/{experiment_id}/" if experiment_id else ""
            lines.append(f"{'':<46}MLflow: {ui_url.rstrip('/')}/#/{exp}runs/{r['mlflow_run_id']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks summary")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--check", action="store_true", help="exit 1 unless every stage finished ok or warn")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    print(render(args.run_dir, cfg.tracking.ui_url))
    if args.check:
        results = load_inputs(args.run_dir)
        return 0 if all(results.get(s, {}).get("status") in ("ok", "warn") for s in STAGES) else 1
    return 0
