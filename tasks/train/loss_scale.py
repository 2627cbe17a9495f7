"""Dynamic loss scaling for FP16 training (`train.precision=fp16`), torch.amp.GradScaler's rule on any layout.

The loss is multiplied by `scale` before backward, so small FP16 gradients do not flush to zero; after the gradient
sync every rank divides its own gradients (its local shards under ZeRO 2/3 and TP, its stage's under PP) by `scale`
and checks them for inf/NaN, and the flag is all-reduced (MAX) over the whole world: every rank skips the same step
(GradScaler checks one process's gradients only). A skipped step multiplies the scale by `backoff` (0.5) and is
counted; `growth_interval` (2000) clean steps in a row multiply it by `growth` (2). GradScaler's defaults
(torch/amp/grad_scaler.py: init_scale 2**16, growth_factor 2.0, backoff_factor 0.5, growth_interval 2000) and the
names of its state_dict; the state goes into every checkpoint's meta.json (every rank holds the same state).

One departure from GradScaler, which has no floor (halved from 2^16, this Python float reached 0 after 1,091
overflows in a row, and the next unscale divided by zero; long before that a scale below FP16's smallest subnormal,
2^-24, flushes every FP16 gradient under 1 to 0): the scale never goes below MIN_SCALE = 1, DeepSpeed's
`min_loss_scale` default (and Megatron-LM's / apex's `min_scale`). At scale 1 the FP16 gradients are the unscaled
ones; a lower scale only shrinks them, pushing the small ones below FP16's smallest normal (2^-14: precision lost)
and its smallest subnormal (2^-24: zero), so an overflow at the floor means FP16 cannot hold this run's gradients at
any useful scale. As with DeepSpeed's `raise_error_at_min_scale`, the run stops: `TrainStep` turns the overflow into
the divergence guard's verdict (`floor_cause`: the cause and the fix), which the trainer stops on as on a non-finite
gradient norm (diagnosis.json, exit 3, not retried).
"""

from __future__ import annotations

import torch

MIN_SCALE = 1.0  # the floor: below it FP16 gradients are scaled down, not protected (module docstring)


class LossScaler:
    def __init__(self, scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000):
        self.scale, self.growth, self.backoff, self.interval = float(scale), growth, backoff, interval
        self.tracker = 0  # clean steps since the last growth or skip (GradScaler's _growth_tracker)
        self.skipped = 0  # steps skipped for inf/NaN gradients, over the whole run

    def unscale_and_check(self, params) -> bool:
        """Divide this rank's gradients by the scale; True when any rank's gradients hold an inf or NaN."""
        from tasks import collectives
        from tasks.train.hooks import local

        grads = [local(p.grad) for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if torch.distributed.is_initialized():
            collectives.all_reduce(found, op=torch.distributed.ReduceOp.MAX)  # every rank skips the same step
        return bool(found.item())

    @property
    def at_floor(self) -> bool:
        """An overflow now cannot be cured by a lower scale (a checkpoint from before the floor may hold less)."""
        return self.scale <= MIN_SCALE

    def floor_cause(self) -> str:
        """The one line naming why an overflow at the floor stops the run, and the fix."""
        return (
            f"FP16 gradients overflowed (inf/NaN) even at the loss scale floor {MIN_SCALE:g} (skipped steps: "
            f"{self.skipped}; FP16 cannot hold them at any useful scale: train in bf16 with train.precision=bf16, or "
            "fp32 where the device has no bf16, lower train.lr, or check this step's data)"
        )

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff, MIN_SCALE)
            self.tracker = 0
            self.skipped += 1
            return
        self.tracker += 1
        if self.tracker == self.interval:
            self.scale *= self.growth
            self.tracker = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_factor": self.growth,
            "backoff_factor": self.backoff,
            "growth_interval": self.interval,
            "_growth_tracker": self.tracker,
            "skipped_steps": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.tracker = float(state["scale"]), int(state["_growth_tracker"])
        self.growth, self.backoff = state["growth_factor"], state["backoff_factor"]
        self.interval, self.skipped = int(state["growth_interval"]), int(state.get("skipped_steps", 0))
