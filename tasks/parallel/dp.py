"""Replicated data parallelism for ZeRO stages 0 and 1 (stages 2 and 3 are FSDP2: tasks/parallel/fsdp.py).

Stage 0 (DDP's semantics): every dp rank holds the whole (TP/PP-local) model, its gradients and optimizer state;
after backward the gradients are averaged over the dp group with bucketed all-reduces.
Stage 1 (ZeRO-1, optimizer state partitioning): the same, but each dp rank owns a subset of the parameters (balanced
by size, the same split on every rank) and its AdamW holds state for those only; after the update each owner
broadcasts its parameters to the other dp ranks. Parameters may be TP DTensors: only their local tensors travel.
"""

from __future__ import annotations

BUCKET_ELEMS = 1 << 22  # 16 MB of fp32 per all-reduce


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce_grads(params, group, dp: int) -> None:
    """Average the local gradients over the dp group (bucketed, per dtype)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from tasks import collectives

    grads = [_local(p.grad) for p in params if p.grad is not None]
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket, size = [], 0
        for g in same + [None]:
            if g is not None:
                bucket.append(g)
                size += g.numel()
            if bucket and (g is None or size >= BUCKET_ELEMS):
                flat = _flatten_dense_tensors(bucket)
                collectives.all_reduce(flat, group=group)
                flat.div_(dp)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(src)
                bucket, size = [], 0


def owners(named_params, dp: int) -> dict[str, int]:
    """ZeRO-1 split: parameter name → owning dp rank, greedy by local size (largest first), ties by name."""
    load = [0] * dp
    out = {}
    for name, p in sorted(named_params, key=lambda np_: (-_local(np_[1]).numel(), np_[0])):
        r = min(range(dp), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += _local(p).numel()
    return out


def broadcast_params(named_params, owner: dict[str, int], group) -> None:
    """After a ZeRO-1 update: each parameter's new value from its owner to the other dp ranks."""
    import torch

    from tasks import collectives

    with torch.no_grad():
        for name, p in named_params:
            collectives.broadcast(_local(p).data, group=group, group_src=owner[name])
