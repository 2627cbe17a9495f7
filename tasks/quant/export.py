"""ONNX-export-friendly attention for AMCT's classic flows.

AMCT's `quantize_model` / `create_quant_retrain_config` export the model to ONNX at opset 11, where
`aten::scaled_dot_product_attention` has no symbolic (it needs opset >= 14). While `export_friendly(model)` is
active (the `math_attention` model converter, tasks/model/converters.py) every Attention block computes the same
causal softmax(QKᵀ/√d)·V with plain matmul/softmax ops that opset 11 exports; the numerics match SDPA
(tests/test_ascend_paths.py compares them).
"""

from __future__ import annotations

import contextlib
import math

import torch

from tasks.model.converters import ConvertContext, register, restore, swap_classes
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


@register("math_attention")
class MathAttentionConverter:
    """The `math_attention` converter: every Attention computes with MathAttention's opset-11 ops (parameters and
    names untouched); `revert` gives the blocks their SDPA back."""

    def __init__(self, ctx: ConvertContext | None = None):
        self.swapped = []

    def convert(self, model: torch.nn.Module) -> None:
        self.swapped += swap_classes(model, {Attention: MathAttention})

    def revert(self) -> None:
        restore(self.swapped)
        self.swapped = []

    def __repr__(self) -> str:  # each rank logs it after convert: how many blocks compute with opset-11 ops
        return f"math_attention({len(self.swapped)} Attention)"


@contextlib.contextmanager
def export_friendly(model: torch.nn.Module):
    """The math_attention converter for the duration (AMCT's ONNX export), then SDPA again."""
    converter = MathAttentionConverter()
    converter.convert(model)
    try:
        yield model
    finally:
        converter.revert()
