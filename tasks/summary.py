"""The one-screen end-of-run summary: stage, status, key figure, MLflow run link."""

from __future__ import annotations

from pathlib import Path

from data_prep.errors import OneLineParser
from tasks.config import load_config
from tasks.errors import StageError
from tasks import procs
from tasks.fsutil import read_json
from tasks.runner import LOCATION
from tasks.stages import STAGES, TITLES
from tasks.tracking import run_url

APPROVAL_FILE = "approval.json"  # <run-dir>/approval.json: the approve task's outcome (tasks.pipeline writes it)


def read_results(run_dir) -> dict:
    """stage → its `<stage>.json` as a dict; a file that cannot be read, or holds no JSON object, becomes a row of
    its own (status `unreadable`, the file and the cause) instead of ending the summary (one bad file must not hide
    the other stages' outcome). A stage whose file is missing is absent."""
    from tasks.errors import os_error_cause

    results = {}
    for stage in STAGES:
        path = Path(run_dir) / f"{stage}.json"
        if not path.is_file():
            continue
        try:
            r = read_json(path)
            cause = None if isinstance(r, dict) else f"holds a JSON {type(r).__name__}, not the stage's result object"
        except OSError as e:
            cause = os_error_cause(e)
        except ValueError as e:  # JSONDecodeError, invalid UTF-8
            cause = f"not JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        if cause is not None:
            r = {"status": "unreadable", "summary": f"{path}: {cause}; rerun the stage to write it again"}
        results[stage] = r
    return results


def _stage_holder(run_dir) -> dict | None:
    """procs.lock_holder of the run directory when the lock's last taker is one of the pipeline's stages."""
    holder = procs.lock_holder(run_dir)
    return holder if holder and holder.get("stage") in STAGES else None


def _seconds(value) -> str:
    return f"{value:>7.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else f"{'':>7}"


def render(run_dir, cfg=None, experiment_id: str | None = None) -> str:
    """The table; MLflow links on tracking.ui_url() of `cfg` (None: $MLFLOW_UI_URL or the default)."""
    results = read_results(run_dir)
    holder = _stage_holder(run_dir)
    lines = [f"{'stage':<28} {'status':<8} {'secs':>7}  key figure", "-" * 100]
    for stage in STAGES:
        r = results.get(stage)
        started = holder if holder and holder["stage"] == stage else None
        if started and (started["held"] or (r is None and started["held"] is None)):
            who = f"pid {started.get('pid', '?')} on {started.get('host', '?')}, since {started.get('since', '?')}"
            last = f"; last result: {r.get('status', '?')}" if r else ""
            if started["held"]:
                lines.append(f"{TITLES[stage]:<28} {'running':<8} {'':>7}  started ({who}), no result yet{last}")
            else:
                lines.append(
                    f"{TITLES[stage]:<28} {'started':<8} {'':>7}  ({who}) no result yet: still running there, or "
                    "stopped without one"
                )
            continue
        if r is None and started:  # it took the lock, let go and wrote nothing: timed out, killed, interrupted
            lines.append(
                f"{TITLES[stage]:<28} {'stopped':<8} {'':>7}  started {started.get('since', '?')} (pid "
                f"{started.get('pid', '?')}), no result: timed out, killed or interrupted (its log says); rerun it"
            )
            continue
        if r is None:
            lines.append(f"{TITLES[stage]:<28} {'-':<8} {'':>7}  (not run)")
            continue
        lines.append(
            f"{TITLES[stage]:<28} {str(r.get('status') or '?'):<8} {_seconds(r.get('seconds'))}  "
            f"{str(r.get('summary') or '')[:80] if r.get('status') != 'unreadable' else r['summary']}"
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
    if not evaluate.get("version"):
        return []
    name, version = evaluate.get("registered_model", "?"), evaluate["version"]
    path = Path(run_dir) / APPROVAL_FILE
    try:
        answer = read_json(path) if path.is_file() else None
        problem = None if answer is None or isinstance(answer, dict) else "holds no JSON object"
    except (OSError, ValueError) as e:
        problem = f"is unreadable ({e})"
    if problem:
        return ["", f"Model: {name} v{version}: the approval record {path} {problem}; see the approve task's log"]
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
            outcome = f"approved by {answer.get('by', '?')}: v{answer.get('version', version)} is the champion"
        else:
            outcome = f"rejected by {answer.get('by', '?')}: the champion is unchanged"
        out.append(f"Approval: {reason} → {outcome}")
    return out


def main(argv=None, run_config=None) -> int:
    """`run_config(run_dir, config)` → (preset, overrides): the run directory's config as its stages took it
    (tasks.cli passes its dag_run_config; this module does not import the CLI, which imports it)."""
    p = OneLineParser(prog="python -m tasks summary")
    p.add_argument("--run-dir", required=True, help="the run directory whose <stage>.json files are summarised")
    p.add_argument("--config", default=None, help="preset or YAML whose tracking settings build the MLflow links")
    p.add_argument("--check", action="store_true", help="exit 1 unless every stage finished ok or warn")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not args.run_dir.strip() or not run_dir.is_dir():
        raise StageError(f"summary: --run-dir {args.run_dir!r} is not a directory (no run there); check the path")
    if not is_run_dir(run_dir):  # e.g. var/runs/llm_pipeline itself: a table of "(not run)" would say nothing ran
        runs = sorted((d for d in run_dir.iterdir() if d.is_dir() and is_run_dir(d)), key=lambda d: d.stat().st_mtime)
        hint = f"the newest run under it: --run-dir {runs[-1]}" if runs else "give the --run-dir a stage was given"
        raise StageError(
            f"summary: {run_dir} is not a run directory (no <stage>.json, {LOCATION} or dag-run.json in it); {hint}"
        )
    cfg = load_config(*run_config(args.run_dir, args.config)) if run_config else load_config(args.config)
    print(render(args.run_dir, cfg))
    if args.check:
        results = read_results(args.run_dir)
        held = (_stage_holder(args.run_dir) or {}).get("held")
        return 0 if not held and all(results.get(s, {}).get("status") in ("ok", "warn") for s in STAGES) else 1
    return 0


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds anything a stage or a DAG run writes at its top (a result, the location marker, the
    DAG run's record, the CLI's remembered config, the lock)."""
    marks = (LOCATION, "dag-run.json", "cli-config.json", ".lock", *(f"{s}.json" for s in STAGES))
    return any((path / m).exists() for m in marks) or any(path.glob("*-node*.json"))
