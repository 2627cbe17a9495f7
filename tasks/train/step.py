"""The one training step, shared by the smoke stage (one process) and the trainer (every rank of a torchrun job).

`TrainStep` = forward and backward (`PlainStep`: gradient accumulation over micro-batches; `PipelineStep`: a
pipeline schedule) → the global loss → gradient sync over data-parallel replicas (ZeRO 0/1) → global gradient norm
and clipping → optimizer and LR-schedule step → `after_update` callbacks (ZeRO-1 broadcast, converters'
post_optimizer_hook, the trainer's hooks) → gradients released. Before the update, `check(loss, grad_norm)` (the
trainer's divergence guard; by default: both finite) may return a verdict: the update is skipped and the gradients that
produced it kept, for diagnosis (the caller zeroes them before going on). The loss and the norm are read to the host
there, once (where the finite check read them before the guard existed); the caller logs those floats.

Each stage is a small method so later work replaces one without touching the rest: FP16 loss scaling
(tasks/train/loss_scale.py) scales the loss in the forward/backward and unscales after the gradient sync, skipping
the step when any rank's gradients overflowed; overlapped DP replaces `grad_sync` by bucket hooks registered before
the step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from tasks.model.loss import lm_loss
from tasks.parallel.optim import grad_norm_and_clip


class PlainStep:
    """No pipeline: accumulate gradients over the micro-batches of this rank's share of the global batch."""

    def __init__(self, model, n_microbatches: int, autocast=None, loss_fn=lm_loss, scaler=None):
        from tasks.model.moe import set_aux_scale

        self.model, self.n, self.loss_fn, self.scaler = model, n_microbatches, loss_fn, scaler
        self.autocast = autocast or contextlib.nullcontext
        set_aux_scale(model, 1.0 / n_microbatches)  # MoE load-balancing loss divided like the LM loss below

    def __call__(self, x, y) -> torch.Tensor:
        total = torch.zeros((), device=x.device)
        for i, (xi, yi) in enumerate(zip(x.chunk(self.n), y.chunk(self.n))):
            if hasattr(self.model, "set_requires_gradient_sync"):
                # FSDP reduce-scatters gradients only after the last micro-batch.
                self.model.set_requires_gradient_sync(i == self.n - 1)
            with self.autocast():
                logits = self.model(xi)
            loss = self.loss_fn(logits, yi) / self.n
            (loss * self.scaler.scale if self.scaler else loss).backward()  # FP16: the scaled loss (loss_scale.py)
            total += loss.detach()
        return total

    def loss(self, x, y) -> torch.Tensor:
        """Forward only (validation, under no_grad): this rank's mean loss over x, micro-batch by micro-batch as
        the step does."""
        total = torch.zeros((), device=x.device)
        for xi, yi in zip(x.chunk(self.n), y.chunk(self.n)):
            with self.autocast():
                logits = self.model(xi)
            total += lm_loss(logits, yi) / self.n
        return total


class PipelineStep:
    """A pipeline schedule: the first stage feeds tokens, the last computes the loss per micro-batch (the
    schedule scales gradients by 1/n_microbatches, so the result is the mean, as without a pipeline)."""

    def __init__(self, schedule, stage_indices: list[int], n_stages: int, autocast=None, scaler=None):
        self.schedule, self.scaler = schedule, scaler  # with a scaler the schedule's loss_fn returns the scaled loss
        self.autocast = autocast or contextlib.nullcontext
        self.first = 0 in stage_indices
        self.last = n_stages - 1 in stage_indices

    def __call__(self, x, y) -> torch.Tensor:
        return self._run(self.schedule.step, x, y)

    def loss(self, x, y) -> torch.Tensor:
        """Forward only (validation, under no_grad): the schedule's `eval` (no backward; torch re-initialises the
        stages' communication for the mode switch, shape inference under fork_rng), as torchtitan's Validator
        (torchtitan/components/validate.py: pp_schedule.eval). This rank's mean loss; 0 off the last stage."""
        return self._run(self.schedule.eval, x, y)

    def _run(self, run, x, y) -> torch.Tensor:
        losses = [] if self.last else None
        target = y if self.last else None
        with self.autocast():
            if self.first:
                run(x, target=target, losses=losses)
            else:
                run(target=target, losses=losses)
        if self.last:
            mean = torch.stack([loss.detach().float() for loss in losses]).mean()
            return mean / self.scaler.scale if self.scaler else mean
        return torch.zeros((), device=x.device)


def global_loss(local: torch.Tensor, dp: int, tp: int) -> torch.Tensor:
    """The global batch's mean loss on every rank: ranks holding a loss (all of them, or the last pipeline
    stage) contribute; the TP ranks of one replica hold the same value, hence the division by dp · tp."""
    from tasks import collectives

    total = local.detach().float().clone()
    collectives.all_reduce(total)
    return total / (dp * tp)


def finite(loss: float, grad_norm: float) -> str | None:
    """The default check: a non-finite loss or gradient norm stops the update."""
    return None if math.isfinite(loss) and math.isfinite(grad_norm) else "non-finite loss or gradient norm"


@dataclass
class StepResult:
    loss: float  # the global batch's mean loss
    grad_norm: float | None  # global pre-clip gradient norm (None: an FP16 step skipped for inf/NaN gradients)
    lr: float  # the learning rate this step used
    verdict: object = None  # what `check` returned: update skipped, gradients kept (None: updated)
    overflow: bool = False  # FP16: some rank's gradients overflowed; the step was skipped, the loss scale lowered

    @property
    def updated(self) -> bool:
        return self.verdict is None and not self.overflow


@dataclass
class TrainStep:
    """One optimizer step. `forward_backward(x, y)` returns this rank's loss with gradients accumulated;
    `optimizers` are (optimizer, LR scheduler or None) per model part; `reduce_loss` (distributed runs) turns the
    local loss into the global one; `grad_sync` averages gradients over replicas; `pp_group` adds the pipeline
    stages' gradient norms; `check(loss, grad_norm)` → None to update, else a verdict that skips it (global values:
    every rank decides the same); `after_update` runs after the optimizers stepped, gradients still held."""

    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizers: list
    params: list
    grad_clip: float
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
    grad_sync: Callable[[], None] | None = None
    pp_group: object = None
    check: Callable[[float, float], object] = finite
    after_update: list[Callable[[], None]] = field(default_factory=list)
    scaler: object = None  # FP16: a tasks.train.loss_scale.LossScaler (the forward_backward scales with it too)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        loss = self.forward_backward(x, y)
        loss = self.reduce_loss(loss) if self.reduce_loss else loss.detach().float()
        if self.grad_sync is not None:
            self.grad_sync()
        lr = self.optimizers[0][0].param_groups[0]["lr"]
        loss = loss.item()
        # FP16: gradients that overflowed under the scale skip the step and lower the scale (GradScaler's rule). A
        # non-finite loss was computed unscaled: no lower scale cures it, so it goes to `check` as under BF16/FP32
        # (the loss is global: every rank takes the same branch).
        if self.scaler is not None and self.scaler.unscale_and_check(self.params) and math.isfinite(loss):
            floor = self.scaler.at_floor  # no lower scale cures this overflow (loss_scale.MIN_SCALE)
            self.scaler.update(found_inf=True)
            if floor:  # the guard's verdict on a non-finite gradient norm, naming the cause: the trainer stops the run
                return StepResult(loss, None, lr, verdict=self.floor_verdict(loss), overflow=True)
            self.zero_grad()
            return StepResult(loss, None, lr, overflow=True)
        norm = self.clip()
        result = StepResult(loss, norm.item(), lr)
        result.verdict = self.check(result.loss, result.grad_norm)
        if result.verdict is None:
            self.update()
            if self.scaler is not None:
                self.scaler.update(found_inf=False)
        return result

    def floor_verdict(self, loss: float):
        """FP16 overflowed at the loss scale floor: `check`'s verdict on the non-finite gradient norm (the trainer's
        guard: a Divergence condemning this step only, the weights untouched), its `what` the scaler's cause and fix.
        The gradients are kept for diagnosis.json (which parameters overflowed), as for any verdict."""
        import dataclasses

        verdict, cause = self.check(loss, math.inf), self.scaler.floor_cause()
        return dataclasses.replace(verdict, what=cause) if dataclasses.is_dataclass(verdict) else cause

    @torch.no_grad()
    def validate(self, batches: list) -> float:
        """The mean loss over `batches` (this rank's share of each global batch of a validation slice), forward
        only: the global value, the same on every rank — each rank's mean over its batches, then `reduce_loss` as for
        the training loss (equal shares, so the mean of the ranks' means is the slice's mean). No parameter, gradient,
        optimizer or RNG state changes."""
        local = torch.stack([self.forward_backward.loss(x, y).float() for x, y in batches]).mean()
        return (self.reduce_loss(local) if self.reduce_loss else local).item()

    def clip(self) -> torch.Tensor:
        """Global gradient norm (exact across FSDP, TP and PP), gradients scaled to at most grad_clip (0 = off)."""
        return grad_norm_and_clip(self.params, self.grad_clip, self.pp_group)

    def update(self) -> None:
        for opt, sched in self.optimizers:
            opt.step()
            if sched is not None:
                sched.step()
        for callback in self.after_update:
            callback()
        for p in self.params:  # a ZeRO-1 optimizer holds only the parameters it owns: clear every gradient here
            p.grad = None

    def zero_grad(self) -> None:
        """After a skipped step, once its gradients have been looked at."""
        for p in self.params:
            p.grad = None


def single_process(
    model, optimizer, grad_clip: float, autocast=None, scheduler=None, converters=(), scaler=None
) -> TrainStep:
    """The step in one process (smoke stage, benchmarks): the whole batch as one micro-batch, no collectives.
    `autocast`: a factory of the autocast context (None = fp32); `converters`: the model converters applied to
    `model`, whose post_optimizer_hook runs after each update; `scaler`: FP16's LossScaler, as the trainer's."""
    from tasks.model.converters import post_optimizer
    from tasks.model.moe import set_loss_scaler

    after = [lambda: post_optimizer(converters, [model])] if converters else []
    if scaler is not None:  # FP16: the MoE aux loss's gradient scaled like the LM loss, as build_step does
        set_loss_scaler(model, scaler)
    params = list(model.parameters())
    plain = PlainStep(model, 1, autocast, scaler=scaler)
    return TrainStep(plain, [(optimizer, scheduler)], params, grad_clip, after_update=after, scaler=scaler)
