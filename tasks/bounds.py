"""Bounded waits: how long each stage may take, and a subprocess wait that ends with its cause.

`stage_timeout_s()` is the one source of every bound: the DAG's per-task `execution_timeout` (set again at task start
from the run's own config by tasks.pipeline.bound_from_run_config: every stage task and the shard fan-out's), the
torchrun wait inside train and profile, and the Kubernetes Job wait (tasks/launch/k8s_job.py). Train's bound is
steps × the planner's step estimate × `timeouts.train_margin` + `timeouts.train_overhead_s` unless `timeouts.train_s`
pins it.
`run_bounded()` kills the whole process tree on expiry and raises a StageError naming the bound, what it was derived
from, and the config key that raises it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.errors import StageError
from tasks.fsutil import read_json

# Without a planner estimate (the plan stage has not run in this run directory): an assumed step time.
FALLBACK_STEP_S = 10.0
# Airflow's execution_timeout is the backstop: it fires this much after the stage's own bound, so the stage's own,
# more specific cause (which rank, which step) is what the operator reads.
GRACE_S = 120
# The most an Airflow execution_timeout may be: the task runner arms it with setitimer, which refuses 2**63 ns (292
# years) and more with an OverflowError, the task's only log line; train.steps up to 1e9 at the fallback 10 s/step
# asked 4e10 s. 10**9 s (31 years) bounds nothing a run can reach.
MAX_TASK_TIMEOUT_S = 10**9


def planner_step_s(run_dir: str | Path | None) -> float | None:
    """The plan stage's estimated seconds per optimizer step for the layout training uses (its `best`)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        return None
    step = (read_json(path).get("best") or {}).get("step_s")
    return float(step) if isinstance(step, (int, float)) and step > 0 else None


def train_timeout(cfg: PipelineConfig, run_dir: str | Path | None = None, steps: int | None = None) -> tuple[int, str]:
    """(seconds, how it was derived) for `steps` optimizer steps (default train.steps)."""
    t = cfg.timeouts
    if t.train_s:
        return t.train_s, "timeouts.train_s"
    steps = cfg.train.steps if steps is None else steps
    est = planner_step_s(run_dir)
    source = "the planner's estimate" if est else f"no planner estimate: {FALLBACK_STEP_S:g} s assumed"
    est = est or FALLBACK_STEP_S
    seconds = int(steps * est * t.train_margin + t.train_overhead_s)
    return seconds, (
        f"{steps} steps × {est:.3g} s/step ({source}) × timeouts.train_margin {t.train_margin:g} + "
        f"timeouts.train_overhead_s {t.train_overhead_s}"
    )


def stage_timeout(stage: str, cfg: PipelineConfig, run_dir: str | Path | None = None) -> tuple[int, str]:
    """(seconds, how it was derived) for one stage run on its launcher."""
    if stage == "train":
        return train_timeout(cfg, run_dir)
    if stage == "profile":  # a few profiled steps of the same trainer: the train formula for those steps
        seconds, how = train_timeout(cfg, run_dir, steps=cfg.profile.steps_needed())
        return max(seconds, cfg.timeouts.profile_s), f"timeouts.profile_s (at least {how})"
    key = f"{stage}_s"
    if not hasattr(cfg.timeouts, key):
        raise StageError(
            f"no timeout for stage {stage!r}: give it one in tasks/config.py, TimeoutConfig: "
            f"{key}: int = Field(<seconds>, ge=1, le=MAX_TIMEOUT_S)"
        )
    return getattr(cfg.timeouts, key), f"timeouts.{key}"


def stage_timeout_s(stage: str, cfg: PipelineConfig, run_dir: str | Path | None = None) -> int:
    return stage_timeout(stage, cfg, run_dir)[0]


def task_timeout_s(stage: str, cfg: PipelineConfig, run_dir: str | Path | None = None) -> int:
    """The Airflow task's execution_timeout: the stage's bound (+ scheduling time for a Job) + a grace period, at most
    MAX_TASK_TIMEOUT_S."""
    seconds = stage_timeout_s(stage, cfg, run_dir) + GRACE_S
    if cfg.hardware.launcher == "kubernetes":
        seconds += cfg.timeouts.k8s_pending_s
    return min(seconds, MAX_TASK_TIMEOUT_S)


def run_bounded(argv: list[str], *, env: dict, cwd, log_path: Path, timeout_s: float, what: str, how: str = "") -> int:
    """Run argv (its own session, output to log_path) to completion within timeout_s; return its exit code.

    On expiry the whole process group (torchrun's agent and every rank) gets SIGTERM, then SIGKILL, and a
    StageError says what did not finish, in how long, from which bound, and where the log is.
    """
    from tasks.procs import run_in_group

    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:  # own process group, dies with this process (tasks.procs)
        try:
            return run_in_group(argv, env=env, cwd=cwd, stdout=log, timeout_s=timeout_s, grace_s=10.0)
        except subprocess.TimeoutExpired:  # run_in_group has already stopped the whole group
            raise StageError(
                f"{what} did not finish within {timeout_s:g} s ({how or 'its bound'}); killed after "
                f"{time.monotonic() - started:.0f} s; see {log_path}. If it was only slow, raise the "
                "bound (timeouts.*)",
                retryable=False,
            ) from None
