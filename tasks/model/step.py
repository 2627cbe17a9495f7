"""The single-process training step (smoke stage, benchmarks): forward, fp32 loss, backward, clip, update.

A non-finite loss or gradient norm skips the update, so the weights (and gradients) that produced it stay in place
for diagnosis.
"""

from __future__ import annotations

import contextlib
import math

import torch

from tasks.model.loss import lm_loss


def train_step(model, optimizer, inputs, targets, autocast=None, grad_clip: float = 1.0) -> tuple[float, float]:
    """One optimizer step; returns (loss, grad_norm) as floats (NaN/Inf when skipped)."""
    with autocast if autocast is not None else contextlib.nullcontext():
        logits = model(inputs)
    loss = lm_loss(logits, targets)
    value = loss.item()
    if not math.isfinite(value):
        return value, float("nan")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf")).item()
    if math.isfinite(norm):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return value, norm  # a skipped step keeps its gradients for diagnosis: zero them before continuing
