"""The language-model loss, shared by smoke, training and evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 whatever the logits' dtype (BF16 log-softmax loses the tail)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
