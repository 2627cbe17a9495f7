"""Step hooks: what runs around the training loop without living inside the step.

A hook subclasses `Hook` and overrides the points it needs; the trainer calls every hook at each point, on every rank
(a hook that runs a collective must do it on all ranks; rank-0-only work checks `trainer.rank`). Points, in order:

    on_start(trainer)                      built and resumed, before the first step
    on_phase(trainer, step, phase)         "data" (first thing of a step) → "compute" → ("validate", sent by
                                           Validation in the after_step round) → ("checkpoint"); "done" at the end
    before_step(trainer, step)             after on_phase "data", before the batch is fetched
    after_update(trainer, step)            the optimizer stepped; gradients still held (released right after)
    after_step(trainer, step, metrics)     a finite step's metrics (every rank, global values), before rank 0 logs
                                           them: add keys to log them; raise StopTraining to end the run (its
                                           message becomes the stage's error line, via train/stopped.json)
    on_checkpoint(trainer, step, path)     a complete checkpoint of `step` is at `path`
    on_end(trainer, summary)               training finished: add keys to summary.json (rank 0 writes it)

Built-in hooks (tasks.train.trainer.default_hooks): `Heartbeats` (per-rank phase files the launcher reads after a
timeout), `FaultInjection` ($LLM_PIPELINE_FAULT, resilience tests and drills), `ShardingEvidence` (what each rank
holds at the end of the last step: the ZeRO stage's proof in summary.json), `Rehearsal`, `Validation`
(tasks/train/validation.py) and `ProgressLines` (tasks/train/progress.py).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

# Fault injection for resilience tests: "RANK:STEP" makes that rank SIGKILL itself at the start of that step, once every
# checkpoint started before it is complete (what a rerun resumes from is then known); "RANK:STEP:hang" makes it stop
# responding there (the others then hit the collective timeout); "RANK:STEP:ckpt" SIGKILLs it while it writes the
# checkpoint of that step (its files written, the checkpoint not yet complete; in the background with
# train.async_checkpoint); "RANK:STEP:inf" makes that rank's first parameter non-finite right after the update of that
# step (an update that blew the weights up while the loss and gradient norm the guard saw were finite);
# "RANK:STEP:overflow" puts an inf into that rank's gradients after that step's gradient sync (the FP16 overflow drill:
# every rank must skip the step); "RANK:STEP:stop" makes it raise StopTraining at the start of that step (a one-rank
# run: what a hook's StopTraining does to the stage).
FAULT_ENV = "LLM_PIPELINE_FAULT"


class StopTraining(Exception):
    """Raised by a hook (every rank, same decision) to end the run with exit `code` after naming the cause."""

    def __init__(self, code: int, message: str):
        if not code:  # exit 0 is a finished run (the worker would export it): a clean early end is finish_early
            raise ValueError("StopTraining needs a non-zero code; to end cleanly, call trainer.finish_early(reason)")
        super().__init__(message)
        self.code = code


class Hook:
    """No-op at every point; override the ones you need."""

    def on_start(self, trainer) -> None:
        pass

    def before_step(self, trainer, step: int) -> None:
        pass

    def on_phase(self, trainer, step: int, phase: str) -> None:
        pass

    def after_update(self, trainer, step: int) -> None:
        pass

    def after_step(self, trainer, step: int, metrics: dict) -> None:
        pass

    def on_checkpoint(self, trainer, step: int, path: Path) -> None:
        pass

    def on_end(self, trainer, summary: dict) -> None:
        pass


class Heartbeats(Hook):
    """`<train>/heartbeat/rank-K.json` rewritten at each phase: after a collective timeout the launcher names the
    rank that fell behind (tasks.parallel.diagnosis)."""

    def __init__(self, directory: Path, rank: int):
        from tasks.parallel.metrics import Heartbeat

        self.beat = Heartbeat(directory, rank)

    def on_phase(self, trainer, step: int, phase: str) -> None:
        self.beat.beat(step, phase)


FAULT_KINDS = ("kill", "hang", "ckpt", "inf", "overflow", "stop")
EXIT_STOPPED = 7  # the "stop" drill's StopTraining code (3–6 are the trainer's own: tasks/train/trainer.py)


def parse_fault(text: str) -> tuple[int, int, str] | None:
    """$LLM_PIPELINE_FAULT → (rank, step, one of FAULT_KINDS; "kill" when none is given), None when unset;
    ValueError (one line) when malformed — a typo must not silently run without the fault a test or drill asked
    for. ASCII digits only: str.isdigit takes '²' (which int() refuses), and re's digit class without re.ASCII takes
    other scripts' digits."""
    if not text.strip():
        return None
    if not re.fullmatch(rf"\d+:\d+(?::(?:{'|'.join(FAULT_KINDS)}))?", text.strip(), re.ASCII):
        raise ValueError(
            f"{FAULT_ENV}={text!r} is malformed: expected RANK:STEP or RANK:STEP:{'|'.join(FAULT_KINDS)} in ASCII "
            "digits (e.g. 1:4); unset it for a normal run"
        )
    rank, step, *kind = text.strip().split(":")
    return int(rank), int(step), kind[0] if kind else "kill"


class FaultInjection(Hook):
    """At the start of `step` this rank SIGKILLs itself ("kill") or stops responding ("hang"); "ckpt": it dies while
    writing the checkpoint of `step` (tasks.parallel.checkpoint.CheckpointManager.crash_at); "inf": its first
    parameter turns non-finite after the update of `step`; "overflow": an inf
    in its gradients at `step`; "stop": it raises StopTraining there, as a hook ending the run does (a one-rank
    drill: every rank of a real hook decides the same)."""

    def __init__(self, step: int, kind: str):
        self.step, self.kind = step, kind

    @classmethod
    def from_env(cls, rank: int, env=None) -> "FaultInjection | None":
        fault = parse_fault((env if env is not None else os.environ).get(FAULT_ENV, ""))
        return cls(fault[1], fault[2]) if fault and fault[0] == rank else None

    def on_start(self, trainer) -> None:
        if self.kind == "ckpt":
            trainer.ckpt.crash_at = self.step

    def after_update(self, trainer, step: int) -> None:
        if step == self.step and self.kind == "inf":
            import torch

            with torch.no_grad():
                local(trainer.params[0]).view(-1)[0] = float("inf")

    def before_step(self, trainer, step: int) -> None:
        if step != self.step or self.kind in ("ckpt", "inf"):
            return
        if self.kind == "overflow":
            self.poison(trainer.step_fn)
            return
        if self.kind == "stop":
            raise StopTraining(EXIT_STOPPED, f"fault injection: stop at step {step}")
        trainer.ckpt.wait()  # this rank's part of a background save in flight is written and agreed first
        print(
            f"[{time.strftime('%H:%M:%S')} rank {trainer.rank}] fault injection: {self.kind} at step {step}", flush=True
        )
        if self.kind == "hang":
            time.sleep(24 * 3600)
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def poison(step_fn) -> None:
        """This rank's first gradient becomes inf after this step's gradient sync (once): the FP16 overflow drill —
        only this rank sees it, every rank must skip the step."""
        sync = step_fn.grad_sync

        def poisoned():
            if sync is not None:
                sync()
            next(local(p.grad) for p in step_fn.params if p.grad is not None).view(-1)[0] = float("inf")
            step_fn.grad_sync = sync

        step_fn.grad_sync = poisoned


def local(t):
    """This rank's part of a tensor (a DTensor's local shard, or the tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ShardingEvidence(Hook):
    """What this rank holds (elements of its local tensors) at the end of the last step — parameters, gradients,
    optimizer state, and one layer between forward and backward (pp = 1) — gathered into summary.json's
    `sharding_per_rank`: the evidence of the ZeRO stage (tests/test_parallel.py checks it)."""

    def __init__(self, last_step: int):
        self.last_step, self.record, self._probe, self._after_forward = last_step, None, None, None

    def before_step(self, trainer, step: int) -> None:
        if step != self.last_step or trainer.lay.pp > 1:
            return
        root = trainer.parts[0]
        block = next(iter(root.layers.values()))

        def after_forward(*_):  # how much of one layer this rank holds between forward and backward (ZeRO 2 vs 3)
            self._after_forward = sum(local(p).numel() for p in block.parameters())

        self._probe = (block, root.register_forward_hook(after_forward))

    def after_update(self, trainer, step: int) -> None:
        if step != self.last_step:
            return
        from torch.distributed.tensor import DTensor

        params = trainer.params
        block = None
        if self._probe is not None:
            block, handle = self._probe
            handle.remove()
        self.record = {
            "param_elems": sum(local(p).numel() for p in params),
            "grad_elems": sum(local(p.grad).numel() for p in params if p.grad is not None),
            "optim_elems": sum(
                local(t).numel()
                for opt, _ in trainer.optimizers
                for st in opt.state.values()
                for t in st.values()
                if hasattr(t, "numel") and t.dim() > 0
            ),
            "full_elems": sum(p.numel() for p in params),
            "layer_elems_after_forward": self._after_forward,
            "layer_elems_at_rest": sum(local(p).numel() for p in block.parameters()) if block is not None else None,
            "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        }

    def on_end(self, trainer, summary: dict) -> None:
        from tasks import collectives

        everyone = [None] * trainer.world
        collectives.all_gather_object(everyone, self.record)
        summary["sharding_per_rank"] = everyone


class Rehearsal(Hook):
    """The first `spec["steps"]` steps of this launch against the plan (tasks/planner/rehearsal.py): each rank's peak
    memory over those steps (the allocator's peak on an accelerator; on CPU the RSS high-water mark less what the
    process held before the model existed) and the step time (the first step left out). Every rank
    hears every rank's figures, so all reach the same verdict; rank 0 writes train/rehearsal.json; a failed verdict
    raises StopTraining with its one-line cause (before the step's checkpoint: nothing half-trusted is written)."""

    def __init__(self, spec: dict, start: int, last_step: int):
        self.sp, self.peak, self.times = spec, 0, []
        self.judge_at = min(start + spec["steps"], last_step)

    def after_step(self, trainer, step: int, metrics: dict) -> None:
        if step > self.judge_at:
            return
        from tasks.device import memory_stats

        # a checkpoint resets the peak counter (its own phase): the max over the steps' readings is their peak
        self.peak = max(self.peak, memory_stats(trainer.device)["peak_bytes"])
        self.times.append(metrics["step_time_s"])
        if step == self.judge_at:
            self.judge(trainer)

    def judge(self, trainer) -> None:
        from tasks import collectives
        from tasks.fsutil import atomic_write_json
        from tasks.planner import rehearsal

        times = self.times[1:] or self.times
        base = trainer.phases.base_bytes if trainer.device.type == "cpu" else 0
        everyone = [None] * trainer.world
        collectives.all_gather_object(everyone, (self.peak, self.peak - base, sum(times) / len(times)))
        peaks, held, step_s = [e[0] for e in everyone], [e[1] for e in everyone], max(e[2] for e in everyone)
        # On CPU what a rank held beyond its pre-model RSS (interpreter, torch, gloo: host memory on a real device)
        # is its device memory, the planner's estimate's and hardware.device_memory_gb's counterpart.
        v = rehearsal.verdict(self.sp, held if trainer.device.type == "cpu" else peaks, step_s, held)
        record = {**v, "steps": len(self.times), "peaks_per_rank": peaks, "held_per_rank": held}
        if trainer.rank == 0:
            atomic_write_json(trainer.train_dir / "rehearsal.json", record)
        if not v["ok"]:
            raise StopTraining(EXIT_REHEARSAL, v["cause"])


EXIT_REHEARSAL = 6  # the rehearsal stopped the run (train/rehearsal.json holds the verdict)
