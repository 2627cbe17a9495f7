"""The per-rank Trainer: built from the small steps of tasks/train/build.py, runs the loop, checkpoints, summarises.

`Trainer.__init__` reads as the list of what a rank builds; `train_step` does one step (batch → TrainStep → metrics →
checkpoint); everything optional sits in hooks (tasks/train/hooks.py) or contexts entered around the loop (the
profiler). Exit codes of `fit`: 0 done (at the last step, or early: a hook's `finish_early`), 3 stopped by the
divergence guard (non-finite, diverged or dead: the update of that step is skipped, diagnosis.json written), 4 out of
memory, 5 collective timeout, 6 stopped by the rehearsal (train/rehearsal.json); any other a hook's StopTraining code
(its cause in train/stopped.json, which every StopTraining writes).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tasks.train.hooks import FaultInjection, Heartbeats, Hook, Rehearsal, ShardingEvidence, StopTraining
from tasks.units import GB

if TYPE_CHECKING:
    import torch
    from data_prep.loader import ShardLoader
    from tasks.config import PipelineConfig
    from tasks.model import TransformerConfig
    from tasks.parallel.checkpoint import CheckpointManager
    from tasks.layout import Layout
    from tasks.parallel.divergence import Divergence, DivergenceGuard
    from tasks.parallel.metrics import MetricsLog, PhasePeaks
    from tasks.train.build import ModelParts, Optimizers
    from tasks.train.step import StepResult, TrainStep

EXIT_DIVERGED, EXIT_OOM, EXIT_TIMEOUT = 3, 4, 5


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} rank {os.environ.get('RANK', '0')}] {msg}", flush=True)


def redirect_output(log_path: Path) -> None:
    """stdout/stderr of this rank (including C++ warnings and tracebacks) go to <run-dir>/logs/rank-K.log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def read_spec(spec: dict) -> tuple["PipelineConfig", "TransformerConfig", "Layout"]:
    """The launch spec (written by tasks/stages/train.py) → the run's config, model shape and layout."""
    from tasks.config import PipelineConfig, apply_overrides
    from tasks.model import TransformerConfig
    from tasks.layout import Layout

    cfg = apply_overrides(PipelineConfig(), {k: v for k, v in spec["config"].items() if k != "preset"})
    return cfg, TransformerConfig(**spec["model"]), Layout(**spec["layout"])


def default_hooks(trainer: "Trainer") -> list[Hook]:
    """Heartbeats for the launcher, $LLM_PIPELINE_FAULT when set for this rank, the ZeRO sharding evidence, the
    validation loss (and early stopping) when the launch spec plans it, the rehearsal when the launch spec carries one
    (the train stage's, with train.rehearsal_steps > 0), rank 0's progress lines (after the validation: they show its
    loss)."""
    from tasks.train.progress import ProgressLines
    from tasks.train.validation import Validation

    fault = FaultInjection.from_env(trainer.rank)
    plan = trainer.spec.get("validation")
    sp = trainer.spec.get("rehearsal")
    return [
        Heartbeats(trainer.train_dir / "heartbeat", trainer.rank),
        *([fault] if fault else []),
        ShardingEvidence(trainer.cfg.train.steps),
        *([Validation(plan, trainer.cfg.train.early_stop_patience)] if plan else []),
        *(
            [Rehearsal(sp, trainer.start, trainer.cfg.train.steps)]
            if sp and trainer.start < trainer.cfg.train.steps
            else []
        ),
        ProgressLines(trainer.cfg.train.steps, trainer.cfg.train.log_every),
    ]


class Trainer:
    """One rank of a training run (torchrun started it; the process group is up)."""

    spec: dict
    device: "torch.device"
    cfg: "PipelineConfig"
    tcfg: "TransformerConfig"
    lay: "Layout"
    run_dir: Path
    train_dir: Path
    rank: int
    world: int
    phases: "PhasePeaks"
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    coords: dict[str, int]
    ckpt: "CheckpointManager"
    model: "ModelParts"
    opts: "Optimizers"
    step_fn: "TrainStep"
    loader: "ShardLoader"
    batches: Iterator  # (inputs, targets) from the resumed position, epochs looped
    start: int
    last_good: str | None
    metrics: "MetricsLog | None"  # rank 0 only
    guard: "DivergenceGuard"  # checks each step's loss and gradient norm before its update
    flops_tok: float  # training FLOPs per token (MFU)
    peak: float | None  # the device's peak FLOP/s (None: unknown, no MFU)
    hooks: list[Hook]
    step: int  # the step running (or last run)
    stalls: list[float]  # seconds each checkpoint held training up (the whole save, or its staging)
    history: list[dict]  # a resumed run's metrics.jsonl rows up to its step ({step, loss, val.loss, val.samples})
    save_now: bool  # a hook asks for a checkpoint of the running step (reset after it)
    # {step, reason}: a hook ended the run cleanly (finish_early), or the resumed checkpoint had
    early_stop: dict | None
    export_from: str | None  # the checkpoint to export (a hook's choice: early stopping's best); None = the newest

    def __init__(self, spec: dict, device, hooks: tuple[Hook, ...] = ()):
        """The build steps in order: spec → mesh → checkpoints (which to resume) → model parts → optimizer → train
        step → loader → resumed state → metrics, guard and hooks; then every rank waits for the others."""
        import torch
        import torch.distributed as dist
        from tasks import collectives

        from tasks.parallel.checkpoint import CheckpointManager
        from tasks.parallel.mesh import coords, layout_name
        from tasks.parallel.metrics import PhasePeaks
        from tasks.train.build import build_loader, build_mesh, build_optimizer, build_step, choose_resume

        self.spec, self.device, self.stalls = spec, device, []
        self.cfg, self.tcfg, self.lay = read_spec(spec)
        self.run_dir = Path(spec["run_dir"])
        self.train_dir = self.run_dir / "train"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        redirect_output(self.run_dir / "logs" / f"rank-{self.rank}.log")
        self.phases = PhasePeaks(device)
        self.phases.enter("init")
        self.mesh = build_mesh(self.lay, device.type)
        self.coords = coords(self.mesh)
        ep = f"·ep{self.lay.ep}" if self.lay.ep > 1 else ""
        log(f"layout {layout_name(self.lay.dp, self.lay.tp, self.lay.pp)}{ep} coords {self.coords} device {device}")
        torch.manual_seed(self.cfg.train.seed)
        t = self.cfg.train
        ckpt_args = (t.keep_checkpoints, self.rank, self.coords, self.lay.dp, self.world, device.type, t.timeout_s)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", *ckpt_args)
        source = choose_resume(spec, self.ckpt, self.rank, log)
        # A training checkpoint wins; without one, model.hf_path's weights (if set) are the starting point.
        self.model = self.build_model(None if source else spec.get("init_from"))
        named = [(n, p) for part in self.parts for n, p in part.named_parameters()]
        self.opts = build_optimizer(self.parts, named, self.mesh, self.lay, t)
        self.step_fn = build_step(
            self.model, self.opts, self.mesh, self.lay, device, t.precision, t.grad_clip, t.compile
        )
        self.step_fn.after_update.append(lambda: self.call("after_update", self.step))
        self.loader = build_loader(spec, self.cfg, self.lay, self.coords["dp"], device)
        self.save_now, self.early_stop, self.export_from, self.stopped = False, None, None, False
        self.start, self.last_good = self.resume(source)
        self.step = self.start
        self.batches = self.loader.batches()
        self.metrics = self.build_metrics()
        self.guard = self.build_guard()
        self.step_fn.check = lambda loss, norm: self.guard.check(self.step, loss, norm)
        self.hooks = [*default_hooks(self), *hooks]
        collectives.barrier()
        self.phases.enter("train")

    def build_model(self, init_from: str | None) -> "ModelParts":
        """This rank's model parts (tasks/train/build.py build_model) with the run's model converters, logged."""
        from tasks.model.converters import ConvertContext
        from tasks.model.converters import build as build_converters
        from tasks.train.build import build_model

        t = self.cfg.train
        if init_from:
            log(f"initialising from {init_from}")
        ctx = ConvertContext(self.device.type, self.tcfg, self.cfg, self.lay)
        converters = build_converters(self.cfg.model.converters, ctx)
        parts = build_model(
            self.tcfg, self.lay, self.mesh, self.device, t.precision, t.seed, init_from, converters, t.compile
        )
        if converters:
            log(f"model converters: {', '.join(map(repr, converters))}")
        return parts

    @property
    def parts(self) -> list:
        return self.model.modules

    @property
    def params(self) -> list:
        return self.step_fn.params

    @property
    def optimizers(self) -> list:
        return self.opts.pairs

    def call(self, point: str, *args) -> None:
        """Every hook's `point` (tasks/train/hooks.py), in order."""
        for hook in self.hooks:
            getattr(hook, point)(self, *args)

    def resume(self, source: str | None) -> tuple[int, str | None]:
        """Model, optimizer, LR schedule, loader position and RNG from checkpoint `source` → (its step, its path)."""
        from data_prep.errors import DataPrepError

        if not source:
            return 0, None
        start = 0
        try:
            start, notes = self.ckpt.load(Path(source), self.parts, self.optimizers, self.loader)
        except DataPrepError as e:  # e.g. loader workers changed: the weights resume, the data stream restarts
            notes = [str(e)]
        notes = list(notes)
        scaler_state = self.ckpt_meta(source).get("loss_scaler")
        if self.step_fn.scaler is not None and scaler_state:
            self.step_fn.scaler.load_state_dict(scaler_state)
            notes.append(f"loss scale {self.step_fn.scaler.scale:g}")
        log(f"resumed from {source} at step {start}" + "".join(f"; {n}" for n in notes))
        from tasks.parallel.checkpoint import read_meta

        stopped = read_meta(Path(source)).get("early_stop")
        if stopped and self.cfg.train.early_stop_patience:  # finished early: nothing left to train (patience 0 goes on)
            self.early_stop = stopped
            log(f"the run stopped early at step {stopped['step']}: not training on (--fresh starts over)")
        return start, str(source)

    @staticmethod
    def ckpt_meta(source: str) -> dict:
        from tasks.parallel.checkpoint import read_meta

        return read_meta(Path(source))

    def build_metrics(self) -> "MetricsLog | None":
        """Rank 0's metrics.jsonl (+ MLflow), truncated to the resumed step; MFU's FLOPs per token and device peak."""
        from tasks.model import flops_per_token
        from tasks.parallel.metrics import MetricsLog, peak_flops

        self.flops_tok = flops_per_token(self.tcfg, self.cfg.data.seq_len)
        self.peak = peak_flops(self.device, self.cfg.hardware.peak_tflops)
        if self.rank != 0:
            return None
        return MetricsLog(self.run_dir / "metrics.jsonl", self.start)

    def build_guard(self) -> "DivergenceGuard":
        """The divergence guard (tasks/parallel/divergence.py), its median and best loss carried over a resume: rank 0
        reads the records of steps <= start from metrics.jsonl and every rank hears them (one broadcast, here: while
        rank 0 truncates the file nobody else reads it; kept in `history` for the hooks: the validation's best).
        Each step's loss and gradient norm are global values, the same on every rank, so every rank's guard then
        reaches the same verdict without a collective."""
        from tasks import collectives
        from tasks.parallel.divergence import DivergenceGuard
        from tasks.parallel.metrics import read_metrics

        history = [None]
        if self.rank == 0:
            path = self.run_dir / "metrics.jsonl"
            rows = read_metrics(path) if self.start and path.is_file() else []
            keep = ("step", "loss", "val.loss", "val.samples")
            history[0] = [{k: r[k] for k in keep if k in r} for r in rows if r["step"] <= self.start]
        collectives.broadcast_object_list(history, src=0)
        self.history = history[0]
        return DivergenceGuard(
            self.tcfg.vocab_size, self.cfg.train.divergence_factor, [r["loss"] for r in self.history]
        )

    def fit(self, profile_dir: str | None = None) -> int:
        """Steps start+1 … train.steps inside the profiler context; the exit code (module docstring)."""
        from tasks.device import memory_stats
        from tasks.parallel import diagnosis
        from tasks.profiling.collect import make_profiler

        self.call("on_start")
        try:
            with make_profiler(self.cfg.profile, self.device.type, profile_dir, self.rank) as prof:
                for step in range(self.start + 1, self.cfg.train.steps + 1):
                    if self.early_stop:
                        break
                    self.train_step(step)
                    prof.step()
        except StopTraining as stop:
            log(f"stopping: {stop}")
            self.ckpt.close()  # every rank stops at the same step: the checkpoint in flight completes first
            self.stopped = True
            if self.rank == 0:  # the cause, for the launcher's one line (the rank logs are not what a user reads)
                from tasks.fsutil import atomic_write_json

                record = {"step": self.step, "code": stop.code, "cause": str(stop)}
                atomic_write_json(self.train_dir / "stopped.json", record)
            return stop.code
        except Exception as e:  # OOM and timeouts leave evidence for the launcher; anything else is a bug
            kind = "oom" if diagnosis.is_oom(e) else "timeout" if diagnosis.is_timeout(e) else None
            if kind is None:
                raise
            from tasks.train.failures import write_failure

            log(f"{kind}: {e}")
            mem = memory_stats(self.device)
            write_failure(self.train_dir, kind, self.rank, self.step, mem, self.spec.get("estimate_bytes"), str(e))
            return EXIT_OOM if kind == "oom" else EXIT_TIMEOUT
        self.finish()
        return 0

    def train_step(self, step: int) -> None:
        """One step: batch → TrainStep (the divergence guard checks it before the update) → metrics (hooks, then rank
        0 logs) → checkpoint when due. A verdict of the guard stops the run (`stop`)."""
        from tasks.device import synchronize

        self.step = step
        self.call("on_phase", step, "data")  # first: a rank that dies in before_step is seen at this step
        self.harvest(wait=False)
        self.call("before_step", step)
        t0 = time.perf_counter()
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t_data = time.perf_counter() - t0
        self.call("on_phase", step, "compute")
        result = self.step_fn(x, y)
        if result.verdict is not None:
            self.stop(result.verdict)
        synchronize(self.device)
        metrics = self.step_metrics(step, result, time.perf_counter() - t0, t_data)
        self.call("after_step", step, metrics)
        if self.metrics is not None:
            self.metrics.log(metrics)
        t = self.cfg.train
        if (
            (t.checkpoint_every and step % t.checkpoint_every == 0)
            or step == t.steps
            or self.save_now
            or self.early_stop
        ):
            self.check_weights(step, result)
            self.checkpoint(step)
        self.save_now = False

    def check_weights(self, step: int, result: "StepResult") -> None:
        """Before a checkpoint is written (the last step's too, which is exported): every rank's shard of every
        parameter is finite (one all-reduce). The guard saw this step's loss and gradient norm before the update; an
        update that still blew the weights up (an fp16/bf16 overflow in the optimizer, a huge lr) is caught here and
        stops the run like a divergence: never saved, exported or trusted by a rerun."""
        import torch

        from tasks import collectives
        from tasks.parallel.divergence import Divergence
        from tasks.train.hooks import local

        # Counted on the device and summed there: one host sync (the all-reduce's), not one `.item()` per parameter.
        counts = [(~torch.isfinite(local(p).detach())).sum().to(self.device) for p in self.params]
        bad = torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64, device=self.device)
        flag = bad.clamp(max=2**30).to(torch.int32)
        collectives.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            what = "the weights became non-finite in the update (its loss and gradient norm were finite)"
            self.stop(Divergence(step, what, result.loss, result.grad_norm, step, "before the checkpoint"))

    def finish_early(self, reason: str) -> None:
        """A hook ends the run cleanly after the running step (every rank, same decision; early stopping): the step is
        logged and checkpointed (its meta.json records `early_stop`: a rerun does not train on), then `finish` writes
        the summary and the worker exports, as at the last step."""
        self.early_stop = {"step": self.step, "reason": reason}
        log(f"finishing early at step {self.step}: {reason}")

    def stop(self, verdict: "Divergence") -> None:
        """The guard's verdict (every rank has the same): rank 0 writes diagnosis.json naming the last good checkpoint
        (the newest before the condemned weights: the launcher sets those aside), then the run ends — no summary, no
        export. Raises StopTraining."""
        from tasks.parallel.checkpoint import complete_checkpoints
        from tasks.train.failures import write_diagnosis

        self.harvest(wait=True)  # the checkpoint in flight may be the last good one: complete it first
        good = [str(p) for s, p in complete_checkpoints(self.ckpt.dir) if s < verdict.bad_from]
        last_good = good[-1] if good else None
        write_diagnosis(self.train_dir, self.rank, verdict, self.parts, last_good)
        raise StopTraining(
            EXIT_DIVERGED, f"{verdict.what} at step {verdict.step}; last good checkpoint {last_good or 'none'}"
        )

    def step_metrics(self, step: int, result: "StepResult", dt: float, t_data: float) -> dict:
        """The step's record for metrics.jsonl (every rank computes it: the MoE statistics are a collective)."""
        from tasks.device import memory_stats
        from tasks.train.router_stats import moe_metrics

        moe_layers = [f"layers.{i}.moe" for i in range(self.tcfg.n_layers) if self.tcfg.is_moe_layer(i)]
        moe = moe_metrics(self.parts, moe_layers, self.tcfg.n_experts, self.lay.tp, self.device)
        tps = self.lay.global_batch * self.cfg.data.seq_len / dt
        return {
            **moe,
            "step": step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "data_wait_s": t_data,
            "mfu": self.flops_tok * tps / (self.peak * self.world) if self.peak else None,
            "peak_mem_gb": memory_stats(self.device)["peak_bytes"] / GB,
            **self.scaler_metrics(result),
        }

    def scaler_metrics(self, result: "StepResult") -> dict:
        """FP16: the loss scale the next step uses and the steps skipped so far (train.loss_scale in MLflow)."""
        scaler = self.step_fn.scaler
        if scaler is None:
            return {}
        return {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped, "overflow": result.overflow}

    def checkpoint(self, step: int) -> Path:
        """A complete DCP checkpoint of this step (tasks/parallel/checkpoint.py); its memory is its own phase. With
        train.async_checkpoint the step waits only for the staging copy (after the previous save in flight has
        completed): the checkpoint becomes the last good one once complete (`harvest`). Returns its path."""
        from tasks.parallel.checkpoint import shaping_config

        t0 = time.perf_counter()
        self.call("on_phase", step, "checkpoint")
        self.phases.enter("checkpoint")
        meta = {
            "model": self.spec["model"],
            "layout": self.spec["layout"],
            "config_hash": self.spec.get("config_hash", ""),
            "shaping": shaping_config(self.spec["config"]),
            **({"early_stop": self.early_stop} if self.early_stop else {}),
            **({"loss_scaler": self.step_fn.scaler.state_dict()} if self.step_fn.scaler else {}),  # same on every rank
        }
        if self.cfg.train.async_checkpoint:
            self.harvest(wait=True)
            pending = self.ckpt.save_async(step, self.parts, self.optimizers, self.loader, meta)
            log(f"checkpoint step-{step}: staged in {pending.staged_s:.3f} s, written in the background")
            self.phases.enter("train")
            self.stalls.append(time.perf_counter() - t0)
            return pending.path
        path = self.ckpt.save(step, self.parts, self.optimizers, self.loader, meta)
        self.phases.enter("train")
        self.stalls.append(time.perf_counter() - t0)
        self.saved(step, path)
        return path

    def harvest(self, wait: bool) -> None:
        """The background save in flight, once complete on every rank, becomes the last good checkpoint and the hooks
        hear of it. `wait` blocks for it (every rank calls it at the same point); otherwise the ranks first agree
        that it is complete everywhere (one all-reduce per step while a save is in flight), so that every rank takes
        it at the same step."""
        import torch

        from tasks import collectives

        pending = self.ckpt.pending
        if pending is None:
            return
        if not wait:
            done = torch.tensor(int(pending.future.done()), dtype=torch.int32, device=self.device)
            collectives.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
            if not done.item():
                return
        self.ckpt.wait()
        log(f"checkpoint step-{pending.step} complete")
        self.saved(pending.step, pending.path)

    def saved(self, step: int, path: Path) -> None:
        """Checkpoint `step` is complete at `path`."""
        self.last_good = str(path)
        self.call("on_checkpoint", step, path)

    def finish(self) -> None:
        """Every rank's memory (per phase) gathered; hooks add their parts; rank 0 writes train/summary.json."""
        from tasks import collectives

        from tasks.device import memory_stats
        from tasks.fsutil import atomic_write_json

        self.harvest(wait=True)  # the final checkpoint is complete before the summary names it (and export reads it)
        self.ckpt.close()
        self.call("on_phase", self.step, "done")
        train_mem = memory_stats(self.device)
        phases = self.phases.result()
        train_mem["peak_bytes"] = train_mem["peak_reserved_bytes"] = phases.get("train", train_mem["peak_bytes"])
        peaks, by_phase = [None] * self.world, [None] * self.world
        collectives.all_gather_object(peaks, train_mem)
        collectives.all_gather_object(by_phase, phases)
        summary = {
            "final_step": self.step,
            "start_step": self.start,
            "checkpoint": self.last_good,
            "checkpoint_stall_s": [round(x, 4) for x in self.stalls],  # training held up per checkpoint (this rank)
            "memory_per_rank": peaks,
            "memory_phases_per_rank": by_phase,
            "layout": self.spec["layout"],
            "early_stop": self.early_stop,
        }
        self.call("on_end", summary)
        summary["export_from"] = self.export_from or self.last_good  # what the worker exports (if it exports)
        if self.rank == 0:
            self.metrics.close()
            atomic_write_json(self.train_dir / "summary.json", summary)
        log(f"done at step {self.step}")
