"""Hybrid-parallel training: checks the layout, then starts torchrun (one process per device; tasks/launch/) running
tasks.train.worker; DCP checkpoints under <run-dir>/checkpoints, resumed automatically; per-step metrics in
<run-dir>/metrics.jsonl and MLflow; the final model exported to <run-dir>/hf in HF format by the workers themselves
(streamed from the final checkpoint, a few tensors per rank at a time).

Multi-node: run the same command on every node with hardware.nnodes, hardware.node_rank and
hardware.rdzv_endpoint (the first node's host:port) set; the nodes meet through torchrun's static rendezvous.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path

from tasks import layout as layouts
from tasks import runner, tracking
from tasks.config import PipelineConfig
from tasks.errors import ConfigError, StageError
from tasks.fsutil import atomic_save_figure, atomic_write_json, fsync_dir, read_json
from tasks.launch import binding, torchrun
from tasks.logs import relay
from tasks.model.model_dir import identity_problem
from tasks.parallel import checkpoint as ckpt
from tasks.parallel import rank_errors
from tasks.parallel.mesh import layout_name
from tasks.parallel.metrics import read_metrics
from tasks.train.hooks import FAULT_ENV, parse_fault
from tasks.units import GB


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    runner.add_shard_dir_arg(parser)
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0: this run's checkpoints, metrics and train/ are set aside (.fresh-old) and deleted "
        "once the new run writes its first checkpoint",
    )
    parser.add_argument("--no-export", action="store_true", help="skip the HF export to <run-dir>/hf")


def prepare(cfg: PipelineConfig, ctx) -> dict:
    """Everything checked before a worker starts; returns the launch spec. Raises ConfigError (one line each)."""
    from data_prep.errors import DataPrepError
    from data_prep.manifest import check_files, load_manifest
    from tasks.model import converters, from_pipeline

    shard_dir = runner.shard_set(cfg, ctx)  # data.seq_len follows the shard set unless set explicitly
    try:
        manifest = load_manifest(shard_dir)
        check_files(shard_dir, manifest, "train", sha256=cfg.data.verify_sha256)  # hashed here, once per launch
    except DataPrepError as e:
        raise ConfigError(f"shards: {e}") from None
    tcfg = from_pipeline(cfg, vocab_size=manifest["vocab_size"])
    # An unknown model converter fails here, not in every rank (after the checks that need no torch: the providers
    # import it, and a refused launch stays light).
    converters.check_names(cfg.model.converters)
    plan = ctx.inputs.get("plan")
    backend, nproc, world = torchrun.world(cfg, plan)
    lay = layouts.resolve(cfg, plan, world)
    # Built once here as the ranks will build them: what a converter refuses (qat_int8 under TP) fails before launch.
    converters.build(cfg.model.converters, converters.ConvertContext(backend.kind, tcfg, cfg, lay))
    hw = cfg.hardware
    hint = (
        "; on CPU hardware.nproc_per_node=0 launches dp × tp × pp ranks"
        if hw.nproc_per_node and not backend.is_accelerator
        else ""
    )
    problems = layouts.check(
        lay, tcfg, cfg.data.seq_len, world, f"hardware.nnodes {hw.nnodes} × {nproc} processes per node{hint}"
    )
    problems.extend(filter(None, [fault_problem(os.environ.get(FAULT_ENV, ""), world)]))
    from data_prep.loader import batch_problem  # every rank's loader would refuse it, after the launch

    fix = "lower train.global_batch, or shard more data (a larger corpus or a shorter data.seq_len)"
    problems.extend(filter(None, [batch_problem(manifest, "train", lay.local_batch, lay.dp, fix)]))
    validation, val_notes = validation_plan(cfg, lay, manifest, shard_dir, problems)
    from tasks.device import hccl_timeout_problem, precision_problem

    problems.extend(
        filter(
            None,
            [
                precision_problem(backend.kind, cfg.train.precision),
                hccl_timeout_problem(backend.kind, cfg.train.timeout_s, hw),
            ],
        )
    )
    if cfg.train.compile:
        from tasks.parallel.compile import compile_problem

        problems.extend(filter(None, [compile_problem(backend.kind, lay.tp)]))
    fresh = getattr(ctx.args, "fresh", False)
    if cfg.hardware.node_rank == 0:
        drop_set_aside(ctx.run_dir)  # an earlier --fresh run has written its first checkpoint: the old run can go
    # With --fresh the old checkpoints are not resumed (nor compared); they are set aside only once all is checked.
    last, warnings_ = (None, []) if fresh else _resume_point(cfg, ctx.run_dir / "checkpoints")
    model = dataclasses.asdict(tcfg)
    if last:
        changes = ckpt.config_changes(last[1], cfg.to_dict())
        if changes and not finished_at(cfg, last):  # a finished run is not resumed: run() refuses the changes
            warnings_.append(
                f"resuming from {last[1].name} with training-shaping config changed since it was "
                f"saved: {'; '.join(changes)} (the curve will differ from an uninterrupted run; use "
                f"--fresh to start over)"
            )
        meta = ckpt.read_meta(last[1])
        problems.extend(
            filter(
                None,
                [
                    ckpt.unsafe_state(last[1]),
                    None if finished_at(cfg, last) else ckpt.resume_problem(last[1], cfg.to_dict()),
                    ckpt.shard_set_problem(last[1], shard_dir),
                    identity_problem(
                        meta.get("tokenizer"),
                        shard_dir,
                        f"checkpoint {last[1]}",
                        "resume on the shard set it was trained on, or start over with --fresh",
                    ),
                ],
            )
        )
        saved = meta["model"]
        diff = [f"{k} {saved.get(k)} vs {v}" for k, v in model.items() if saved.get(k) != v]
        if diff:
            problems.append(
                f"checkpoint {last[1]}: written for another model shape ({', '.join(diff[:3])}); "
                f"use --fresh or another --run-dir"
            )
    init_from = _init_from(cfg)  # its files verified (sizes + sha256, safetensors headers)
    if init_from:
        from tasks.model.hf_io import carried, tokenizer_problem

        problems.extend(filter(None, [tokenizer_problem(init_from, shard_dir)]))
        dropout = carried(init_from).get("attention_dropout") or 0.0
        if dropout:
            warnings_.append(
                f"model.hf_path's config.json sets attention_dropout {dropout}: this trainer applies no dropout, so "
                f"the run trains without it (the export keeps attention_dropout {dropout})"
            )
    if problems:
        raise ConfigError(problems)
    warnings_.extend(val_notes)
    warnings_.extend(filter(None, [tcfg.capacity_note()]))  # trained with capacity, exported dropless
    if cfg.data.loader_workers == 0 and "data.prefetch_factor" in cfg.explicit:  # torch prefetches only in workers
        warnings_.append(
            f"data.prefetch_factor {cfg.data.prefetch_factor} is not used: data.loader_workers 0 reads batches in the "
            "training process; set data.loader_workers (>= 1, or -1) to prefetch, or leave data.prefetch_factor out"
        )
    smoke = ctx.inputs.get("smoke", {})
    if smoke.get("status") == "failed":  # the DAG stops here; by hand it is the user's call, said
        warnings_.append(
            f"the smoke stage failed in this run directory ({str(smoke.get('error', ''))[:200]}): training anyway, as "
            "asked (the DAG would not train this model); rerun smoke first to check it"
        )
    t = cfg.train
    if t.warmup_steps > t.steps:  # the linear warm-up never ends: the run never trains at train.lr, nor decays
        warnings_.append(
            f"train.warmup_steps {t.warmup_steps} > train.steps {t.steps}: the learning rate never reaches "
            f"train.lr {t.lr:g} (it ends warming up at {t.lr * t.steps / t.warmup_steps:.3g}); lower "
            "train.warmup_steps (or raise train.steps)"
        )
    if fresh and cfg.hardware.node_rank == 0:  # every check passed: only now is anything of the old run moved
        kept = set_aside(ctx.run_dir)
        if kept:
            warnings_.append(
                f"--fresh: the earlier run's {', '.join(kept)} are kept in {ctx.run_dir / ASIDE} until this run "
                "writes its first checkpoint"
            )
    for w in warnings_:
        print(f"warning: {w}", file=sys.stderr, flush=True)
    return {
        "config": cfg.to_dict(),
        "init_from": init_from,
        "config_hash": cfg.digest(),
        "model": model,
        "layout": lay.to_dict(),
        "shard_dir": str(shard_dir),
        "run_dir": str(ctx.run_dir),
        "resume": True,
        **({"resume_from": str(last[1]) if last else None} if cfg.hardware.node_rank == 0 else {}),
        "warnings": warnings_,
        "shards_verified": cfg.data.verify_sha256,
        "estimate_bytes": _estimate(cfg, tcfg, lay, backend.kind),
        "validation": validation,
        "backend": backend.kind,
        "nproc": nproc,
        "world": world,
    }


def validation_plan(cfg: PipelineConfig, lay, manifest: dict, shard_dir: Path, problems: list[str]):
    """The validation slice and cadence (tasks.train.validation.plan) → (plan or None, warning lines); the val
    shards checked like the train ones. Without a usable val split early stopping cannot work: a problem."""
    from data_prep.errors import DataPrepError
    from data_prep.manifest import check_files
    from tasks.train.validation import plan

    validation, notes = plan(cfg.train, lay, manifest)
    if validation is None and cfg.train.early_stop_patience and notes:
        problems.append(f"train.early_stop_patience {cfg.train.early_stop_patience} needs the {notes[0]}")
        return None, []
    if validation is not None:
        try:
            check_files(shard_dir, manifest, "val", sha256=cfg.data.verify_sha256)
        except DataPrepError as e:
            problems.append(f"shards (val split, for the validation loss): {e}")
    return validation, notes


# What --fresh starts over (logs/ stays); hf/ too: an export of the old run must not pass for the new run's model.
FRESH_OUTPUTS = ("checkpoints", "train", "metrics.jsonl", "hf")
ASIDE = ".fresh-old"


def set_aside(run_dir: Path) -> list[str]:
    """--fresh, after every check: the old run's outputs are renamed into <run-dir>/.fresh-old (renames within one
    directory: nothing is copied, nothing deleted) and removed only once the new run has a complete checkpoint
    (drop_set_aside). A set-aside that is still waiting holds the last real run: it is kept, and what the
    interrupted fresh attempt left (no complete checkpoint, else the set-aside would be gone) is discarded."""
    run_dir = Path(run_dir)
    aside = run_dir / ASIDE
    present = [name for name in FRESH_OUTPUTS if (run_dir / name).exists()]
    if aside.exists():
        for name in present:
            p = run_dir / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return sorted(p.name for p in aside.iterdir())
    if not present:
        return []
    tmp = run_dir / f"{ASIDE}.tmp"
    tmp.mkdir(exist_ok=True)
    for name in present:
        os.rename(run_dir / name, tmp / name)
    os.rename(tmp, aside)  # complete: from here on the set-aside is what a crash or a retry sees
    fsync_dir(run_dir)
    return present


def drop_set_aside(run_dir: Path) -> None:
    """Delete the set-aside old run once this run has a complete checkpoint; put back a set-aside interrupted
    halfway (.fresh-old.tmp: some outputs moved, the new run never started)."""
    run_dir = Path(run_dir)
    tmp = run_dir / f"{ASIDE}.tmp"
    if tmp.is_dir():
        for p in tmp.iterdir():
            if not (run_dir / p.name).exists():
                os.rename(p, run_dir / p.name)
        shutil.rmtree(tmp)
    if (run_dir / ASIDE).is_dir() and ckpt.latest(run_dir / "checkpoints"):
        shutil.rmtree(run_dir / ASIDE)


def fault_problem(text: str, world: int) -> str | None:
    """$LLM_PIPELINE_FAULT checked before launch: malformed (tasks.train.hooks.parse_fault), or a rank outside the
    world (the drill would silently run without its fault)."""
    try:
        fault = parse_fault(text)
    except ValueError as e:
        return str(e)
    if fault and fault[0] >= world:
        return f"{FAULT_ENV}={text!r}: rank {fault[0]} does not exist (world size {world}); use a rank below {world}"
    return None


def _init_from(cfg: PipelineConfig) -> str | None:
    """model.hf_path as an absolute path when its weights start the training (a checkpoint, if any, still wins),
    its files verified. (An override that changes a weight shape was refused by tasks.model.resolve above.)"""
    if not cfg.model.hf_path:
        return None
    from tasks.config import repo_path
    from tasks.model.model_dir import verify

    path = repo_path(cfg.model.hf_path)
    verify(path)  # every rank reads it next: a truncated or altered file is one line here, not zeros there
    return str(path)


def _resume_point(cfg: PipelineConfig, ckpt_dir: Path) -> tuple[tuple[int, Path] | None, list[str]]:
    """Node 0: the newest checkpoint that verifies (sizes and sha256 recorded at save), with a warning naming each
    newer one skipped; other nodes only look (node 0's decision reaches their ranks by broadcast)."""
    if cfg.hardware.node_rank != 0:
        return ckpt.latest(ckpt_dir), []
    ckpt.cleanup_partial(ckpt_dir)
    found, skipped = ckpt.latest_verified(ckpt_dir)
    warnings_ = [
        f"checkpoint {s} — skipped, resuming from {found[1].name if found else 'step 0 (no checkpoint verifies)'}"
        for s in skipped
    ]
    return found, warnings_


def _estimate(cfg: PipelineConfig, tcfg, lay: layouts.Layout, backend: str) -> int | None:
    """The planner's per-device peak for exactly this layout, to compare with the measured: on CPU with the runtime
    reserve, which the measured RSS holds (plan.runtime_reserve_gb, else tasks.planner.cluster.RESERVE_GB); on an
    accelerator without it, which the allocator's peak does not see. None for a mixture-of-experts layout with tp or
    pp > 1, which the MoE planner does not size."""
    from tasks.planner.cluster import RESERVE_GB
    from tasks.planner.memory import estimate

    m = lay.n_microbatches
    # the plan's reserve (plan.runtime_reserve_gb; 0 = the backend's default), so the rehearsal judges the plan's figure
    reserve = (cfg.plan.runtime_reserve_gb or RESERVE_GB["cpu"]) * GB if backend == "cpu" else 0.0
    if tcfg.n_experts:
        from tasks.planner import moe

        return (
            int(
                moe.estimate_for_run(
                    tcfg,
                    cfg.data.seq_len,
                    lay.local_batch // m,
                    lay.dp,
                    lay.ep,
                    lay.zero,
                    lay.recompute,
                    cfg.train.precision,
                    m,
                    recompute_every=lay.recompute_every,
                )
                + reserve
            )
            if lay.tp == lay.pp == 1
            else None
        )
    run = dataclasses.replace(lay, micro_batch=lay.local_batch // m, microbatches=m)
    return int(
        estimate(tcfg, cfg.data.seq_len, run, cfg.train.precision, cfg.train.optimizer, reserve_bytes=reserve)[
            "total_bytes"
        ]
    )


def run(cfg: PipelineConfig, ctx) -> dict:
    from tasks.parallel import diagnosis

    spec = prepare(cfg, ctx)
    run_dir, lay = ctx.run_dir, layouts.Layout(**spec["layout"])
    train_dir = run_dir / "train"
    export = not getattr(ctx.args, "no_export", False) and cfg.hardware.node_rank == 0
    if cfg.hardware.node_rank == 0:  # the verified checkpoint prepare() chose
        last = (ckpt.step_of(spec["resume_from"]), spec["resume_from"]) if spec.get("resume_from") else None
    else:
        last = ckpt.latest(run_dir / "checkpoints")
    newest = ckpt.latest(run_dir / "checkpoints")  # verified or not: a damaged step-M still went past train.steps
    if newest and newest[0] > cfg.train.steps:  # handing back step-N's model as train.steps' would be silent
        raise StageError(
            f"train.steps: {cfg.train.steps}, but {run_dir} already holds checkpoint {Path(newest[1]).name}, trained "
            "past it; use a new --run-dir for a shorter run, or raise train.steps to continue this one"
        )
    finished = finished_at(cfg, last)
    if finished:
        refuse_changed(cfg, Path(last[1]))  # handing back a model trained with other settings would be silent
    if finished and (not export or export_current(run_dir, Path(last[1]))):
        return _result(cfg, ctx, spec, reused=True)  # idempotent: this run already finished
    ep = f"·ep{lay.ep}" if lay.ep > 1 else ""
    tracking.log_params(
        {
            "train.layout": layout_name(lay.dp, lay.tp, lay.pp) + ep,
            **{f"parallel.{k}": v for k, v in spec["layout"].items()},
            "train.world": spec["world"],
            "train.shards": spec["shard_dir"],
        }
    )
    tracking.log_json_artifact(spec, "train/launch.json")
    if cfg.hardware.node_rank == 0:  # evidence of an earlier attempt (other nodes wait for node 0 to rendezvous)
        for stale in (
            "failures",
            "heartbeat",
            "diagnosis.json",
            "summary.json",
            "export_memory.json",
            "rehearsal.json",
            "stopped.json",
        ):
            p = train_dir / stale
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    # The HF export runs inside the job (every rank streams part of it), not in this (Airflow worker) process.
    # Every node's spec says the same (all ranks take part); node 0 checks the result.
    spec["export"] = None if getattr(ctx.args, "no_export", False) else {"tokenizer_dir": spec["shard_dir"]}
    if spec["export"] is not None and cfg.model.hf_path:
        from tasks.config import repo_path

        # the export's special token ids and generation_config.json are this checkpoint's: the shard set (a cache
        # hit on identical tokenizer bytes) may name another checkpoint as its tokenizer's source
        spec["export"]["hf_path"] = str(repo_path(cfg.model.hf_path))
    spec["rehearsal"] = rehearsal_spec(cfg, ctx, spec, lay)
    spec_path = atomic_write_json(train_dir / "launch.json", spec)
    from tasks.bounds import train_timeout

    logs, node = run_dir / "logs", cfg.hardware.node_rank
    elastic_dir = logs / f"torchelastic-node{node}"  # this launch's @record error files only
    shutil.rmtree(elastic_dir, ignore_errors=True)
    elastic_dir.mkdir(parents=True, exist_ok=True)
    offsets = rank_errors.log_offsets(logs)
    argv = torchrun.argv(
        cfg, spec["nproc"], [spec_path], rdzv_id=run_dir.name, log_dir=elastic_dir, backend=spec["backend"]
    )
    log_name = "torchrun.log" if cfg.hardware.nnodes == 1 else f"torchrun-node{node}.log"
    env = torchrun.env(cfg, spec["backend"], spec["nproc"])
    binding.record(env, train_dir)
    with relay_progress(logs, log_name, node), stream_metrics(cfg, ctx, run_dir / "metrics.jsonl", node):
        rc, log_text = torchrun.run(argv, env, logs / log_name, timeout=train_timeout(cfg, run_dir))
    if node == 0:
        drop_set_aside(run_dir)  # a --fresh run that wrote a checkpoint (even if it failed later) replaces the old one
    if rc != 0:
        from tasks.device import alloc_conf_in_force

        failures = rank_errors.collect(log_text, logs, node, spec["nproc"], offsets)
        disk = rank_errors.disk_fault(run_dir, failures)  # probed before the cleanup below frees anything
        if node == 0:
            ckpt.cleanup_partial(run_dir / "checkpoints")  # a save cut short (step-N.tmp) is garbage, never trusted
        resume = ckpt.latest(run_dir / "checkpoints")
        where = f"checkpoint step-{resume[0]}" if resume else "step 0 (no checkpoint yet)"
        rehearsed = _rehearsed(run_dir)
        if rehearsed and not rehearsed["ok"]:  # the same layout fails the same way: not retried
            _log_rehearsal(rehearsed)
            raise StageError(f"{rehearsed['cause']} (checkpoints kept: {where})")
        if disk:  # a full or read-only disk fails every retry the same way
            raise StageError(
                f"training stopped: {disk}; not retried: fix the disk, then rerun (it resumes from {where})"
            )
        plans = _plans(ctx.inputs.get("plan"))
        raise diagnosis.explain(
            train_dir,
            rc,
            log_text,
            plans,
            spec["layout"],
            where,
            failures=failures,
            kind=spec["backend"],
            alloc_conf=alloc_conf_in_force(spec["backend"], env),
            log_name=log_name,
        )
    if export and not (run_dir / "hf" / "config.json").is_file():
        raise StageError(
            f"training finished but the HF export {run_dir / 'hf'} is missing; see "
            f"{run_dir / 'logs'}/rank-0.log, rerun to export again"
        )
    return _result(cfg, ctx, spec, reused=False)


@contextlib.contextmanager
def relay_progress(logs_dir: Path, torchrun_log: str, node: int):
    """Node 0: rank 0's progress lines (tasks/train/progress.py) into this stage's log while torchrun runs — from
    torchrun's log until the rank has its own (the process group's rendezvous), then from logs/rank-0.log."""
    if node != 0:
        yield
        return
    (logs_dir / torchrun_log).unlink(missing_ok=True)  # torchrun.run rewrites it: relay it from its start
    with relay(logs_dir / torchrun_log), relay(logs_dir / "rank-0.log"):
        yield


@contextlib.contextmanager
def stream_metrics(cfg: PipelineConfig, ctx, path: Path, node: int):
    """Node 0 with an MLflow run: the per-step records rank 0 appends to metrics.jsonl go to this stage's run while
    torchrun runs (tasks.parallel.metrics.MetricsFollower, a thread of this process: no rank imports MLflow, and
    training never waits on it); what it could not send, _log_run's backfill sends after."""
    if node != 0 or not (cfg.tracking.enabled and ctx.mlflow_run_id):
        yield
        return
    from tasks.parallel.metrics import MetricsFollower

    follower = MetricsFollower(path, tracking.tracking_uri(cfg), ctx.mlflow_run_id)
    try:
        yield
    finally:
        follower.close()


def finished_at(cfg: PipelineConfig, last) -> bool:
    """Checkpoint `last` ((step, path) or None) ends the run: train.steps reached, or early stopping finished it."""
    return bool(last) and (last[0] >= cfg.train.steps or stopped_early(cfg, last[1]))


def refuse_changed(cfg: PipelineConfig, checkpoint: Path) -> None:
    """A finished run is handed back only for the training-shaping config it was trained with (a resume warns
    instead: it trains on with the new settings)."""
    changes = ckpt.config_changes(checkpoint, cfg.to_dict())
    if changes:
        raise ConfigError(
            f"checkpoint {checkpoint} ends a finished run trained with other settings ({'; '.join(changes)}): "
            "its model is not what this config asks for; use --fresh to start over, or a new --run-dir"
        )


def export_current(run_dir: Path, last: Path) -> bool:
    """<run-dir>/hf holds the export of this finished run's model: config.json there and, where llm-pipeline.json
    records the checkpoint it was exported from (tasks.model.hf_export), that very checkpoint (name and meta.json
    sha256): the last one, or the one the run's summary says it exports (early stopping's best). An export of an
    earlier run or of an earlier step is not handed back: the launch exports again. Nor is one whose files differ
    from what llm-pipeline.json records (sizes, sha256: the check quantize and evaluate make when they load it)."""
    from tasks.fsutil import sha256_file
    from tasks.model.model_dir import read_manifest, verify

    hf_dir = Path(run_dir) / "hf"
    if not (hf_dir / "config.json").is_file():
        return False
    try:
        source = (read_manifest(hf_dir) or {}).get("checkpoint")
        verify(hf_dir)
    except StageError as e:
        from tasks.logs import log

        cause = str(e).split("; re-export")[0]
        log.warning(f"{cause}: not handed back; exporting {hf_dir} again from the checkpoint")
        return False
    if source is None:  # exported before the source was recorded
        return True
    summary_path = Path(run_dir) / "train" / "summary.json"
    summary = read_json(summary_path) if summary_path.is_file() else {}
    name = Path(summary.get("export_from") or last).name
    meta = Path(run_dir) / "checkpoints" / name / "meta.json"
    return (
        isinstance(source, dict)
        and source.get("name") == name
        and meta.is_file()
        and source.get("meta_sha256") == sha256_file(meta)
    )


def stopped_early(cfg: PipelineConfig, checkpoint) -> bool:
    """The checkpoint ends a run early stopping finished (with early stopping still on: off, a rerun trains on)."""
    return bool(cfg.train.early_stop_patience and ckpt.read_meta(checkpoint).get("early_stop"))


def rehearsal_spec(cfg: PipelineConfig, ctx, spec: dict, lay: layouts.Layout) -> dict | None:
    """The launch spec's `rehearsal` entry (tasks/planner/rehearsal.py): the estimate for the layout being run, what
    one device holds (hardware.device_memory_gb when set, else the cluster preset's; on an accelerator less the
    runtime reserve the allocator never sees; on CPU all of it: what a rank holds beyond its pre-model RSS includes
    the runtime's share, as the estimate does), plan.tolerance (plan.cpu_tolerance on CPU), the plan's step time
    when the plan chose this very layout, and the plan's ranked alternatives. None when train.rehearsal_steps is 0
    or the planner does not size this layout. On CPU the step time is reported, not judged (docs/real-size.md: the
    planner's CPU step time is a nominal figure, and the host is shared)."""
    if not cfg.train.rehearsal_steps or spec["estimate_bytes"] is None:
        return None
    from tasks.planner import rehearsal
    from tasks.planner.cluster import get_cluster

    hw, cpu = cfg.hardware, spec["backend"] == "cpu"
    c = get_cluster(hw.cluster, memory_gb=hw.device_memory_gb, reserve_gb=cfg.plan.runtime_reserve_gb)
    path = (ctx.inputs.get("plan") or {}).get("plan_json")
    doc = read_json(path) if path and Path(path).is_file() else {}
    m = lay.n_microbatches
    run = {
        **{k: getattr(lay, k) for k in ("dp", "tp", "pp", "ep", "zero", "recompute", "pp_schedule")},
        "micro_batch": lay.local_batch // m,
        "microbatches": m,
    }
    planned = doc.get("chosen") or {}
    same = all(planned.get(k) == run[k] for k in ("dp", "tp", "pp", "zero", "recompute", "micro_batch")) and (
        planned.get("ep", 1) == run["ep"] and (run["pp"] == 1 or planned.get("pp_schedule") == run["pp_schedule"])
    )  # another expert split or pipeline schedule is another step time: reported, not judged against this one
    chosen = {**run, "step_s": planned.get("step_s") if same else 0.0}
    capacity = (c.memory_gb - (0.0 if cpu else c.reserve_gb)) * GB
    return rehearsal.spec(
        {"chosen": chosen, "plans": doc.get("plans") or []},
        spec["estimate_bytes"],
        capacity,
        cfg.train.rehearsal_steps,
        cfg.plan.cpu_tolerance if cpu else cfg.plan.tolerance,
        judge_step_time=not cpu,
        tolerance_key="plan.cpu_tolerance" if cpu else "plan.tolerance",
    )


def _rehearsed(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "train" / "rehearsal.json"
    return read_json(path) if path.is_file() else None


def _log_rehearsal(rehearsed: dict) -> None:
    from tasks.planner.rehearsal import figures

    with tracking.best_effort("rehearsal figures"):
        tracking.log_metrics(figures(rehearsed))


def _plans(plan_result: dict | None) -> list[dict]:
    path = (plan_result or {}).get("plan_json")
    return read_json(path).get("plans", []) if path and Path(path).is_file() else []


def _result(cfg: PipelineConfig, ctx, spec: dict, reused: bool) -> dict:
    run_dir, lay = ctx.run_dir, layouts.Layout(**spec["layout"])
    records = read_metrics(run_dir / "metrics.jsonl")
    last = ckpt.latest(run_dir / "checkpoints")
    name = layout_name(lay.dp, lay.tp, lay.pp) + (f"·ep{lay.ep}" if lay.ep > 1 else "")
    hf_dir = run_dir / "hf"
    if cfg.hardware.node_rank != 0:  # rank 0, its metrics and the MLflow logging belong to node 0's launcher
        return {"status": "ok", "summary": f"node {cfg.hardware.node_rank}: trained {name}", "layout": name}
    if not records:
        raise StageError(f"no metrics in {run_dir / 'metrics.jsonl'} although checkpoints exist; rerun with --fresh")
    speeds = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]  # step 1 pays warm-up
    tps = sum(speeds) / len(speeds)
    summary_path = run_dir / "train" / "summary.json"
    summary = read_json(summary_path) if summary_path.is_file() else {}
    peaks = [m["peak_bytes"] for m in summary.get("memory_per_rank", []) if m]
    val = validation_result(records, run_dir / "checkpoints")
    stop = summary.get("early_stop")
    result = {
        "status": "ok",
        "layout": name,
        "steps": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "tokens_per_s": round(tps, 1),
        "mfu": records[-1].get("mfu"),
        "peak_mem_gb": round(max(peaks) / GB, 3) if peaks else None,
        **val,
        "early_stop": stop,
        "exported_from": summary.get("export_from") if hf_dir.is_dir() else None,
        "init_from": spec.get("init_from"),  # model.hf_path's weights it started from (None: random init)
        "shard_dir": spec.get("shard_dir"),  # the set it trained on, and its manifest digest
        "manifest_digest": ckpt.shard_digest(spec["shard_dir"]) if spec.get("shard_dir") else None,
        "reused": reused,
        "metrics": str(run_dir / "metrics.jsonl"),
        "checkpoint_dir": str(run_dir / "checkpoints"),
        "checkpoint": str(last[1]) if last else None,
        "hf_dir": str(hf_dir) if hf_dir.is_dir() else None,
        "warnings": spec.get("warnings", []),
        "rehearsal": _rehearsal_summary(run_dir),
        "binding": [
            f"local rank {e['local_rank']}: CPUs {e['cpulist']} ({e['source']})"
            for e in (
                read_json(run_dir / "train" / "binding.json") if (run_dir / "train" / "binding.json").is_file() else []
            )
        ],
        "summary": f"{records[-1]['step']} steps, loss {records[0]['loss']:.2f}→{records[-1]['loss']:.2f}, "
        + (
            f"val {val['val.loss']:.2f} (best {val['val.best_loss']:.2f} at step {val['val.best_step']}), "
            if val["val.loss"] is not None
            else ""
        )
        + (f"early stop at step {stop['step']}, " if stop else "")
        + f"{_human(tps)} tok/s, {name}"
        + (" (reused)" if reused else ""),
    }
    if not reused:
        _log_run(cfg, ctx, spec, records, result, summary)
    return result


def validation_result(records: list[dict], ckpt_dir: Path) -> dict:
    """train.json's validation figures from metrics.jsonl: the last and the best val.loss (the first step reaching
    it) and the best step's checkpoint when one exists (always, with early stopping: that is what was exported)."""
    evals = [(r["step"], r["val.loss"]) for r in records if r.get("val.loss") is not None]
    if not evals:
        return {"val.loss": None, "val.best_loss": None, "val.best_step": None, "val.best_checkpoint": None}
    best_step, best = min(evals, key=lambda e: (e[1], e[0]))
    path = Path(ckpt_dir) / f"step-{best_step}"
    return {
        "val.loss": evals[-1][1],
        "val.best_loss": best,
        "val.best_step": best_step,
        "val.best_checkpoint": str(path) if (path / "meta.json").is_file() else None,
    }


def _rehearsal_summary(run_dir: Path) -> dict | None:
    """train.json's `rehearsal`: the verdict's figures (tasks.planner.rehearsal.figures), None when none ran."""
    from tasks.planner.rehearsal import figures

    rehearsed = _rehearsed(run_dir)
    return {**figures(rehearsed), "steps": rehearsed["steps"], "cause": rehearsed["cause"]} if rehearsed else None


def _human(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def memory_figures(summary: dict, export_memory: dict | None, estimate_bytes: int | None, backend: str) -> dict:
    """MLflow metrics: each phase's peak per rank (memory.<phase>.peak_gb.rankN), and the planner's estimate over
    the measured training-phase peak of the worst rank. Like with like: the estimate counts the framework's
    tensors (model states + activations); on an accelerator the allocator's peak is exactly that, on CPU the RSS
    peak also holds the interpreter, torch and the process group, so the RSS held before the model existed
    (the phase record's `base`) is subtracted."""
    out = {}
    phases = summary.get("memory_phases_per_rank") or []
    for rank, m in enumerate(summary.get("memory_per_rank") or []):
        if m:
            out[f"memory.peak_gb.rank{rank}"] = m["peak_bytes"] / GB
    for rank, ph in enumerate(phases):
        for phase, peak in (ph or {}).items():
            if phase != "base":
                out[f"memory.{phase}.peak_gb.rank{rank}"] = peak / GB
    for rank, ph in enumerate((export_memory or {}).get("per_rank") or []):
        out[f"memory.export.peak_gb.rank{rank}"] = ph["export"] / GB
        if ph.get("written_bytes"):
            out[f"memory.export.peak_over_written.rank{rank}"] = ph["export"] / ph["written_bytes"]
    measured = [ph["train"] - (ph["base"] if backend == "cpu" else 0) for ph in phases if ph and "train" in ph]
    if estimate_bytes and measured and max(measured) > 0:
        out["memory.estimate_over_measured"] = estimate_bytes / max(measured)
    return out


def memory_headline(figures: dict) -> dict:
    """The two memory metrics of the run: the worst rank's peak and the planner's estimate over the measured
    training peak (the per-phase, per-rank figures go to the table artifact, memory_table)."""
    peaks = [v for k, v in figures.items() if re.fullmatch(r"memory\.peak_gb\.rank\d+", k)]
    out = {"memory.peak_gb": max(peaks)} if peaks else {}
    if "memory.estimate_over_measured" in figures:
        out["memory.estimate_over_measured"] = figures["memory.estimate_over_measured"]
    return out


def memory_table(figures: dict) -> dict[str, list]:
    """memory_figures() as columns for MLflow's table artifact: one row per rank, a column per phase (GB)."""
    cells: dict[int, dict[str, float]] = {}
    for key, value in figures.items():
        m = re.fullmatch(r"memory\.(?:(\w+)\.)?(peak_gb|peak_over_written)\.rank(\d+)", key)
        if m:
            column = f"{m[1] or 'overall'}_{m[2]}"
            cells.setdefault(int(m[3]), {})[column] = round(value, 4)
    columns = sorted({c for row in cells.values() for c in row})
    ranks = sorted(cells)
    return {"rank": ranks, **{c: [cells[r].get(c) for r in ranks] for c in columns}}


def _log_run(cfg: PipelineConfig, ctx, spec: dict, records: list[dict], result: dict, summary: dict) -> None:
    """Stage-run extras from the launcher. The per-step metrics were sent while training ran (stream_metrics);
    whatever was not (an MLflow outage mid-training) is backfilled from metrics.jsonl now, or left pending for the
    next stage.
    Nothing here can fail the stage: the training is done."""
    if ctx.mlflow_run_id:
        tracking.settle_metrics(ctx.run_dir, tracking.tracking_uri(cfg), ctx.mlflow_run_id, result["metrics"])
    final = {"train.final_loss": result["final_loss"], "train.mean_tokens_per_s": result["tokens_per_s"]}
    if result["val.best_loss"] is not None:
        final.update({"train.val.best_loss": result["val.best_loss"], "train.val.best_step": result["val.best_step"]})
    export_path = ctx.run_dir / "train" / "export_memory.json"
    memory = memory_figures(
        summary, read_json(export_path) if export_path.is_file() else None, spec.get("estimate_bytes"), spec["backend"]
    )
    final.update(memory_headline(memory))
    if result.get("rehearsal"):
        from tasks.planner.rehearsal import figures

        final.update(figures(_rehearsed(ctx.run_dir)))
    plot = _loss_plot(records, ctx.run_dir / "train" / "loss.png")
    uri = tracking.tracking_uri(cfg)  # final metrics, tags and artifacts: kept pending while MLflow is down
    tracking.log_final_metrics(ctx.run_dir, uri, final)
    tags = {"train.checkpoint": result["checkpoint"], "train.hf_dir": result["hf_dir"] or ""}
    tracking.set_tags_or_defer(ctx.run_dir, uri, tags, "final training tags")
    files = [(Path(result["metrics"]), None), (plot, "train")]
    tracking.log_artifacts_or_defer(
        ctx.run_dir, uri, files, {"train/memory.json": memory_table(memory)}, "training artifacts"
    )


def _loss_plot(records: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return atomic_save_figure(loss_figure(records, plt), path)


def loss_figure(records: list[dict], plt):
    """The training loss per step and, where evaluated, the validation loss (its best step marked)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evals = [(r["step"], r["val.loss"]) for r in records if r.get("val.loss") is not None]
    if evals:
        ax.plot(*zip(*evals), marker="o", markersize=3, label="val loss")
        best = min(evals, key=lambda e: (e[1], e[0]))
        ax.plot(*best, marker="*", markersize=11, linestyle="none", label=f"best val {best[1]:.3f} (step {best[0]})")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training and validation loss" if evals else "training loss")
    fig.tight_layout()
    return fig
