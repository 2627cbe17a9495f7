"""Replicated data parallelism for ZeRO stages 0 and 1 (stages 2 and 3 are FSDP2: tasks/parallel/fsdp.py).

Stage 0 (DDP's semantics): every dp rank holds the whole (TP/PP-local) model, its gradients and optimizer state;
the gradients are averaged over the dp group in buckets, each all-reduced asynchronously from a backward hook as soon
as its last gradient is accumulated (`GradBuckets`: communication overlaps the rest of backward, as DDP's reducer).
Stage 1 (ZeRO-1, optimizer state partitioning): the same, but each dp rank owns a subset of the parameters (balanced
by size, the same split on every rank) and its AdamW holds state for those only; after the update each owner
broadcasts its parameters to the other dp ranks, coalesced into buckets (`broadcast_params`). Parameters may be TP
DTensors: only their local tensors travel. Every collective goes through tasks.collectives.
"""

from __future__ import annotations

from tasks.layout import DP_BUCKET_BYTES as BUCKET_BYTES
from tasks.layout import DP_FIRST_BUCKET_BYTES as FIRST_BUCKET_BYTES


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def buckets_of(tensors, first_bytes: int = FIRST_BUCKET_BYTES, bytes_: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `tensors` (local tensors, in the order they should be sent) in consecutive buckets: a new bucket
    when the dtype changes or the current one reached its size (the first `first_bytes`, then `bytes_`)."""
    out, size, dtype = [], 0, None
    for i, t in enumerate(tensors):
        cap = first_bytes if len(out) <= 1 else bytes_
        if not out or t.dtype != dtype or size >= cap:
            out.append([])
            size, dtype = 0, t.dtype
        out[-1].append(i)
        size += t.numel() * t.element_size()
    return out


class GradBuckets:
    """The replicas' gradients averaged in buckets launched from backward.

    Parameters are bucketed in reverse order of definition (the order backward produces their gradients). Each
    parameter's post-accumulate-grad hook counts its accumulations; at the step's last one (`accumulations` per
    step: the micro-batches, each a backward through every parameter) the parameter is ready, and every bucket
    whose parameters are all ready is flattened and all-reduced with async_op — strictly in bucket order, so every
    rank issues the same collectives in the same order whatever its timing. `finish()` (before clipping and the
    optimizer) launches the buckets backward did not complete, waits for all, and writes gradient × `scale` / size
    back. `scale`: a factor the caller applies to the gradients after backward (a pipeline schedule's
    1/micro-batches, tasks/train/step.PipelineStep), applied here to the buckets the hooks sent (the write-back
    replaces the gradients); a bucket finish() sends already holds the scaled gradients and gets 1 / size only."""

    def __init__(self, params, group, size: int, accumulations: int = 1, scale: float = 1.0, **bucket_bytes):
        self.params = [p for p in reversed(list(params)) if p.requires_grad]
        self.group, self.size, self.accumulations, self.scale = group, size, accumulations, scale
        self.buckets = buckets_of([_local(p) for p in self.params], **bucket_bytes)
        self.bucket_of = {}
        for b, members in enumerate(self.buckets):
            for i in members:
                self.bucket_of[id(self.params[i])] = b
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        self._reset()

    def _reset(self) -> None:
        self.count = {id(p): 0 for p in self.params}
        self.waiting = [len(b) for b in self.buckets]  # parameters not yet at their last accumulation
        self.next = 0  # the next bucket to launch
        self.inflight: list[tuple[int, object, float, object]] = []  # (bucket, flat, factor, work)

    def _accumulated(self, p) -> None:
        k = id(p)
        self.count[k] += 1
        if self.count[k] == self.accumulations:
            self.waiting[self.bucket_of[k]] -= 1
            while self.next < len(self.buckets) and self.waiting[self.next] == 0:
                self._launch(self.next)

    def _launch(self, b: int, scaled: bool = False) -> None:
        """All-reduce bucket `b`; `scaled`: its gradients already hold the caller's `scale` (sent by finish())."""
        from torch._utils import _flatten_dense_tensors

        from tasks import collectives

        grads = [_local(self.params[i].grad) for i in self.buckets[b] if self.params[i].grad is not None]
        if grads:
            flat = _flatten_dense_tensors(grads)
            factor = (1.0 if scaled else self.scale) / self.size
            self.inflight.append((b, flat, factor, collectives.all_reduce(flat, group=self.group, async_op=True)))
        self.next = b + 1

    def finish(self) -> None:
        """Launch what is left (in order), wait, write the averages back; ready for the next step."""
        from torch._utils import _unflatten_dense_tensors

        while self.next < len(self.buckets):
            self._launch(self.next, scaled=True)
        late = [p for p in self.params if self.count[id(p)] > self.accumulations]
        if late:  # a gradient accumulated after its bucket was sent: its average would miss that part
            raise RuntimeError(
                f"data parallel: {len(late)} gradients accumulated {self.count[id(late[0])]} times in one step, "
                f"{self.accumulations} expected (a backward outside the train step's micro-batches?)"
            )
        for b, flat, factor, work in self.inflight:
            work.wait()
            flat.mul_(factor)
            grads = [_local(self.params[i].grad) for i in self.buckets[b] if self.params[i].grad is not None]
            for dst, src in zip(grads, _unflatten_dense_tensors(flat, grads)):
                dst.copy_(src)
        self._reset()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def owners(named_params, dp: int) -> dict[str, int]:
    """ZeRO-1 split: parameter name → owning dp rank, greedy by local size (largest first), ties by name."""
    load = [0] * dp
    out = {}
    for name, p in sorted(named_params, key=lambda np_: (-_local(np_[1]).numel(), np_[0])):
        r = min(range(dp), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += _local(p).numel()
    return out


def broadcast_params(named_params, owner: dict[str, int], group, bytes_: int = BUCKET_BYTES) -> None:
    """After a ZeRO-1 update: each owner's new parameter values to the other dp ranks, coalesced — per owner, its
    parameters flattened into buckets of up to `bytes_`, every bucket broadcast asynchronously, then all written
    back (one collective per bucket, not per parameter)."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from tasks import collectives

    me = dist.get_rank(group)
    by_owner: dict[int, list] = {}
    for name, p in named_params:
        by_owner.setdefault(owner[name], []).append(_local(p).data)
    with torch.no_grad():
        inflight = []
        for src in sorted(by_owner):
            tensors = by_owner[src]
            for idx in buckets_of(tensors, bytes_, bytes_):
                bucket = [tensors[i] for i in idx]
                flat = _flatten_dense_tensors(bucket)
                inflight.append(
                    (src, bucket, flat, collectives.broadcast(flat, group=group, group_src=src, async_op=True))
                )
        for src, bucket, flat, work in inflight:
            work.wait()
            if src == me:  # the owner's values are already in place
                continue
            for dst, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                dst.copy_(value)
