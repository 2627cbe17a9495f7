"""One optimizer step's forward and backward: gradient accumulation over micro-batches, or a pipeline schedule."""

from __future__ import annotations

import contextlib

import torch

from tasks.model import lm_loss


class PlainStep:
    """No pipeline: accumulate gradients over the micro-batches of this rank's share of the global batch."""

    def __init__(self, model, n_microbatches: int, autocast=None):
        from tasks.model.moe import set_aux_scale

        self.model, self.n = model, n_microbatches
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
            loss = lm_loss(logits, yi) / self.n
            loss.backward()
            total += loss.detach()
        return total


class PipelineStep:
    """A pipeline schedule: the first stage feeds tokens, the last computes the loss per micro-batch (the
    schedule scales gradients by 1/n_microbatches, so the result is the mean, as without a pipeline)."""

    def __init__(self, schedule, stage_indices: list[int], n_stages: int, autocast=None):
        self.schedule = schedule
        self.autocast = autocast or contextlib.nullcontext
        self.first = 0 in stage_indices
        self.last = n_stages - 1 in stage_indices

    def __call__(self, x, y) -> torch.Tensor:
        losses = [] if self.last else None
        target = y if self.last else None
        with self.autocast():
            if self.first:
                self.schedule.step(x, target=target, losses=losses)
            else:
                self.schedule.step(target=target, losses=losses)
        if self.last:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return torch.zeros((), device=x.device)


def global_loss(local: torch.Tensor, dp: int, tp: int) -> torch.Tensor:
    """The global batch's mean loss on every rank: ranks holding a loss (all of them, or the last pipeline
    stage) contribute; the TP ranks of one replica hold the same value, hence the division by dp · tp."""
    import torch.distributed as dist

    total = local.detach().float().clone()
    dist.all_reduce(total)
    return total / (dp * tp)
