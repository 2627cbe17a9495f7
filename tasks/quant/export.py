"""ONNX-export-friendly attention for AMCT's classic flows.

AMCT's `quantize_model` / `create_quant_retrain_config` export the model to ONNX at opset 11, where
`aten::scaled_dot_product_attention` has no symbolic (it needs opset >= 14). While `export_friendly(model)` is
active every Attention block computes the same causal softmax(QKᵀ/√d)·V with plain matmul/softmax ops that opset 11
exports; the numerics match SDPA (tests/test_ascend_paths.py compares them).
"""

from __future__ import annotations

import contextlib
import math

import torch

from tasks.model.transformer import Attention


class MathAttention(Attention):
    """Attention with explicit ops: matmul, additive causal mask, softmax in fp32, matmul."""

    def attend(self, q, k, v):
        s_q, s_k = q.size(-2), k.size(-2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        # causal mask from two aranges (aten::tril has no opset-11 symbolic either)
        rows = torch.arange(s_q, device=q.device).unsqueeze(1) + (s_k - s_q)
        mask = torch.arange(s_k, device=q.device).unsqueeze(0) <= rows
        scores = scores.float().masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


@contextlib.contextmanager
def export_friendly(model: torch.nn.Module):
    """Swap every Attention's class to MathAttention for the duration (parameters and names untouched)."""
    swapped = []
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = MathAttention
            swapped.append(module)
    try:
        yield model
    finally:
        for module in swapped:
            module.__class__ = Attention
