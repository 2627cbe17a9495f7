"""Activation checkpointing per transformer block: full (recompute the whole block) or selective (keep matmul and
attention outputs, recompute the cheap element-wise ops), on every k-th block.

The block's `forward` is wrapped in place instead of wrapping the module (checkpoint_wrapper), so parameter names —
and with them the seeded initialisation and DCP checkpoint keys — are the same with and without recompute.
"""

from __future__ import annotations

import functools


NPU_ATTENTION_OPS = ("npu_fusion_attention", "npu_fusion_attention_v3")  # torch.ops.npu.*, where torch_npu has them


def keep_ops() -> set:
    """Ops whose outputs selective recompute saves: matmuls and the attention kernels — SDPA's CPU/CUDA variants
    and, on NPU, op-plugin's npu_fusion_attention{,_v3} (what SDPA dispatches to on 910B+) where registered."""
    import torch

    aten = torch.ops.aten
    keep = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    for name in NPU_ATTENTION_OPS:
        try:
            keep.add(getattr(torch.ops.npu, name).default)
        except (AttributeError, RuntimeError):
            pass  # no torch_npu, or a release without this op
    return keep


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = keep_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, selective: bool):
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    context_fn = _selective_context if selective else noop_context_fn

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # No dropout in the model, so the RNG state need not be replayed (saves a copy per block).
        return checkpoint(
            forward, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn, **kwargs
        )

    return run


def apply_ac(model, mode: str, every: int = 1) -> int:
    """Checkpoint blocks whose layer index is a multiple of `every`; returns how many were wrapped."""
    if mode == "none":
        return 0
    wrapped = 0
    for name, block in model.layers.items():
        if int(name) % every == 0:
            block.forward = _checkpointed(block.forward, selective=(mode == "selective"))
            wrapped += 1
    return wrapped
