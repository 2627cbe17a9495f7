"""ZeRO stages 2 and 3: FSDP2 `fully_shard` over the dp axis of the mesh (composes with TP DTensors: 2-D).

Parameters (fp32), gradients and optimizer states are sharded at rest. ZeRO-3: each layer's parameters are
resharded after its forward and gathered again for backward — except under pipeline parallelism, where they stay
gathered from the first micro-batch's forward to the last one's backward (`Layout.reshard_after_forward`; else every
micro-batch would gather them twice); ZeRO-2: kept gathered from forward through backward (no second all-gather, the
whole model's compute-dtype parameters are resident during the step). Stages 0 and 1 (replicated parameters) are
tasks/parallel/dp.py.
Mixed precision: compute in bf16/fp16, gradients reduced in fp32, master weights and optimizer states fp32.
"""

from __future__ import annotations

PARAM_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def apply_fsdp(model, dp_mesh, precision: str, reshard: bool, dp_rep_mesh=None) -> None:
    """`reshard`: free each block's gathered parameters after its forward (ZeRO-3 without PP:
    Layout.reshard_after_forward). `dp_rep_mesh`: under expert parallelism, the routed experts (already Shard(0)
    over "ep") are sharded over this axis first (tasks.parallel.ep.shard_experts)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    name = PARAM_DTYPES[precision]
    # cast_forward_inputs=False: the RoPE table passed to each block must stay fp32.
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, name) if name else None, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    if dp_rep_mesh is not None:
        from tasks.parallel.ep import shard_experts

        shard_experts(model, dp_rep_mesh, mp, reshard)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root's parameters (embedding, final norm, output) are used last in forward, first in backward:
    # resharding them in between would only add an all-gather.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
