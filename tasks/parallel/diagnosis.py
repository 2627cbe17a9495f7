"""Why a training launch failed, in one line for the operator (after the seeds' troubleshooting tables).

Workers leave evidence in `<run-dir>/train/`: `diagnosis.json` (the divergence guard's verdict, written by rank 0),
`failures/oom-rank-K.json` and `failures/timeout-rank-K.json` (written by the rank that hit it) and heartbeats.
The launcher turns that evidence, torchrun's exit report and the planner's result into a StageError.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from tasks.errors import StageError
from tasks.parallel import rank_errors
from tasks.parallel.metrics import read_heartbeats
from tasks.units import GB

# torch elastic's agent reading a survivor's @record error file while the rank still writes it (after another rank
# died and the agent SIGTERMed the rest) fails on its own JSONDecodeError and prints no end-of-run report:
# torch/distributed/elastic/multiprocessing/errors/__init__.py, ProcessFailure.__post_init__ ("Failed to parse reply
# file: %s", then `raise`).
_AGENT_CRASH = re.compile(r"Failed to parse reply file: (\S*?/attempt_\d+/(\d+)/error\.json)")
PHASES = ("data", "compute", "validate", "checkpoint", "done")  # heartbeat phases within a step, in order


def is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or "watchdog" in text


def oom_advice(stats: dict, kind: str = "npu", alloc_conf: str = "") -> str:
    """Fragmentation (reserved ≫ allocated) may be cured by allocator settings — advice valid for the settings in
    force: `max_split_size_mb` and `garbage_collection_threshold` together with `expandable_segments:True` are an
    error at start-up, not ignored (Ascend/pytorch v2.12.0 torch_npu/csrc/core/npu/NPUAllocatorConfig.cpp parseArgs:
    "cannot be enabled with `expandable_segments`"), and the launcher already sets `expandable_segments:True` on
    NPU. The variable named is the one the workers read (tasks.device.alloc_conf_var). Otherwise the plan must
    change."""
    from tasks.device import alloc_conf_var, parse_alloc_conf

    plan_advice = "raise zero to 3, recompute to full, tp/pp, or lower train.micro_batch"
    alloc, reserved = stats.get("allocated_bytes", 0), stats.get("reserved_bytes", 0)
    if not (reserved and (reserved - alloc) > 0.2 * reserved):
        return f"memory is really in use: {plan_advice}"
    var = alloc_conf_var(kind) or "PYTORCH_NPU_ALLOC_CONF"
    conf = parse_alloc_conf(alloc_conf)
    frag = f"{(reserved - alloc) / GB:.1f} GB reserved but unallocated (fragmentation)"
    if conf.get("expandable_segments", "False").lower() == "true":
        return (
            f"{frag} although {var}={alloc_conf} already uses expandable segments: {plan_advice}; or switch to "
            f"{var}=expandable_segments:False,max_split_size_mb:128,garbage_collection_threshold:0.6 "
            "(with expandable_segments:True, torch_npu refuses max_split_size_mb and garbage_collection_threshold: "
            "an error at start-up)"
        )
    shown = f" (now {var}={alloc_conf})" if alloc_conf else ""
    return f"{frag}{shown}: set {var}=expandable_segments:True, or keep it False and add max_split_size_mb:128"


def next_feasible_plan(plans: list[dict], layout: dict, estimate_bytes: float | None = None, kind: str = "npu") -> str:
    """The planner's best-ranked plan other than the layout that ran out of memory (`layout`: the launch spec's;
    compared as tasks.planner.rehearsal.layout_identity, so a plan differing only in ep or, under PP, the schedule is
    another run), named with the --set flags that pin it (rehearsal.pins). `estimate_bytes`: the planner's figure for
    the failed layout (the OOM file's: without the runtime reserve on an accelerator, with it on CPU). Like
    rehearsal.next_plan, each alternative is scaled by the measured/estimated ratio, which the failure proves is at
    least capacity / estimate; the capacity cancels, so an alternative fits only when its estimate is below the
    failed layout's. The first that does is named; none does: the advice says so; no estimate to compare: the
    best-ranked other plan."""
    from tasks.planner.rehearsal import layout_identity, pins

    run = dict(layout)
    m, dp, batch = layout.get("microbatches"), layout.get("dp"), layout.get("global_batch")
    if m and dp and batch:  # the micro-batch the run used (as train.rehearsal_spec computes it)
        run["micro_batch"] = batch // dp // m
    same = layout_identity(run)
    need = ("dp", "tp", "pp", "zero", "recompute", "micro_batch")  # what pins() names
    others = [p for p in plans if all(k in p for k in need) and layout_identity(p) != same]
    if not others:
        return ""

    def own(p: dict) -> float:  # the alternative's figure in the terms of estimate_bytes
        return p["total_bytes"] - (0.0 if kind == "cpu" else p.get("reserve_bytes", 0.0))

    def name(p: dict) -> str:
        keys = ["dp", "tp", "pp", "zero", "recompute", "micro_batch"] + (["ep"] if p.get("ep", 1) > 1 else [])
        keys += ["pp_schedule"] if p.get("pp", 1) > 1 and p.get("pp_schedule") else []
        return ", ".join(f"{k}={p[k]}" for k in keys if k in p)

    if not estimate_bytes or not all("total_bytes" in p for p in others):
        return f"{name(others[0])}: {pins(others[0])}"
    fit = next((p for p in others if own(p) < estimate_bytes), None)
    if fit is None:
        return (
            f"none — no other planned layout is estimated below the {estimate_bytes / GB:.1f} GB of the one that ran "
            "out: lower train.micro_batch or add devices"
        )
    return f"{name(fit)} (estimated {own(fit) / GB:.1f} GB/device): {pins(fit)}"


def _torchrun_failures(log_text: str) -> list[tuple[int, int]]:
    """[(rank, exitcode)] from torchrun's end-of-run failure report, the root cause first."""
    return rank_errors.torchrun_failures(log_text)


def _where(beat: dict) -> str:
    return f"step {beat['step']} {beat['phase']}"


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def explain(
    train_dir: Path,
    rc: int,
    torchrun_log: str,
    plans: list[dict],
    layout: dict,
    resume_from: str,
    failures: list | None = None,
    kind: str = "npu",
    alloc_conf: str = "",
    log_name: str = "torchrun.log",
) -> StageError:
    """`failures`: rank_errors.collect() of this launch (each failed rank with the exception it left, if any);
    `kind`/`alloc_conf`: the backend and the allocator settings in force (OOM advice valid for them); `log_name`:
    the file in logs/ torchrun's own output went to (the train stage's: torchrun-node<N>.log with several nodes)."""
    train_dir = Path(train_dir)
    diag = train_dir / "diagnosis.json"
    if diag.is_file():
        d = json.loads(diag.read_text())
        last_good, aside = d["last_good_checkpoint"], ""
        if d.get("bad_from") is not None:  # the divergence guard condemned the weights from that step on
            from tasks.parallel.checkpoint import latest
            from tasks.parallel.divergence import quarantine

            moved = quarantine(train_dir.parent / "checkpoints", int(d["bad_from"]))
            found = latest(train_dir.parent / "checkpoints")
            last_good = str(found[1]) if found else None
            aside = f"; set aside as diverged: {', '.join(moved)}" if moved else ""
            aside += "; lower train.lr or raise train.warmup_steps and rerun (the schedule follows the new config)"
        return StageError(
            f"{d['what']} at step {d['step']} (loss {d['loss']:.4g}, grad norm {d['grad_norm']:.4g}); "
            f"stopped {d.get('stopped', 'before the update')}, last good checkpoint {last_good or 'none'}{aside}; "
            f"see {diag}",
            retryable=False,
        )
    stopped = train_dir / "stopped.json"
    if stopped.is_file():  # a hook's StopTraining: its decision, the same on a retry
        s = json.loads(stopped.read_text())
        return StageError(
            f"training stopped at step {s['step']}: {s['cause']} (a hook's StopTraining, exit {s['code']}); not "
            f"retried; it resumes from {resume_from}",
            retryable=False,
        )
    ooms = sorted((train_dir / "failures").glob("oom-rank-*.json"))
    if ooms:
        o = json.loads(ooms[0].read_text())
        s = o["memory"]
        est = f"planner estimated {o['estimate_bytes'] / GB:.1f} GB/device; " if o.get("estimate_bytes") else ""
        nxt = next_feasible_plan(plans, layout, o.get("estimate_bytes"), kind)
        return StageError(
            f"out of memory on rank {o['rank']} at step {o['step']}: {est}allocated "
            f"{s['allocated_bytes'] / GB:.1f} GB, reserved {s['reserved_bytes'] / GB:.1f} GB; "
            f"{oom_advice(s, kind, alloc_conf)}" + (f"; next feasible plan: {nxt}" if nxt else ""),
            retryable=False,
        )
    beats = read_heartbeats(train_dir / "heartbeat")
    root = rank_errors.root_cause(failures or [])
    if root is not None and root.python_exception:  # the rank's own error: a retry would fail the same way
        step = beats.get(root.rank, {}).get("step", "?")
        return StageError(
            f"rank {root.rank} failed at step {step}: {root.exc_type}: {root.message} "
            f"(from the {root.source}); not retried: fix the cause, then rerun (it resumes from "
            f"{resume_from})",
            retryable=False,
        )
    timeouts = sorted((train_dir / "failures").glob("timeout-rank-*.json"))
    if timeouts:
        progress = {r: (b["step"], PHASES.index(b["phase"]) if b["phase"] in PHASES else 0) for r, b in beats.items()}
        front = max(progress.values(), default=(0, 0))
        behind = sorted(r for r, p in progress.items() if p < front)
        who = (
            (
                f"ranks {behind} did not arrive (stuck at {', '.join(_where(beats[r]) for r in behind[:4])}; the "
                f"others reached {front[0]} {PHASES[front[1]]})"
            )
            if behind
            else "no rank fell behind by heartbeat (a network or clock problem between nodes)"
        )
        return StageError(
            f"collective timed out: {who}; run `python -m tasks env` to check clock offsets and "
            f"link bandwidth between nodes; a retry resumes from {resume_from}",
            retryable=True,
        )
    if root is not None:
        rank, code = root.rank, root.exitcode
        step = beats.get(rank, {}).get("step", "?")
        what = f"{root.exc_type}: {root.message}" if root.exc_type else _exit_text(code)
        return StageError(
            f"rank {rank} died ({what}) at step {step}; see logs/rank-{rank}.log; a retry resumes from {resume_from}",
            retryable=True,
        )
    failures = _torchrun_failures(torchrun_log)
    if failures:
        rank, code = failures[0]
        step = beats.get(rank, {}).get("step", "?")
        return StageError(
            f"rank {rank} died ({_exit_text(code)}) at step {step}; see logs/rank-{rank}.log; "
            f"a retry resumes from {resume_from}",
            retryable=True,
        )
    crash = _AGENT_CRASH.search(torchrun_log)
    if crash:  # no end-of-run report to read: name what happened and where the dead rank's own lines are
        local = crash.group(2)
        return StageError(
            f"a rank stopped, then torchrun's elastic agent crashed reading local rank {local}'s error file while "
            f"that rank was still writing it (a torch elastic race), so torchrun named no failed rank: see "
            f"logs/rank-*.log and logs/{log_name}; a retry resumes from {resume_from}",
            retryable=True,
        )
    if rc < 0:  # torchrun itself was killed (its ranks went with it): the log's last lines are not the cause
        return StageError(
            f"torchrun was {_exit_text(rc)} from outside (the kernel's OOM killer, an operator, a scheduler's "
            f"preemption: dmesg or the scheduler's events say which); see logs/{log_name}; a retry resumes from "
            f"{resume_from}",
            retryable=True,
        )
    tail = " | ".join(torchrun_log.strip().splitlines()[-3:])
    return StageError(
        f"torchrun exited with code {rc}: {tail}; see logs/{log_name}; a retry resumes from {resume_from}",
        retryable=True,
    )
