"""Expert parallelism (EP) for the mixture-of-experts layers (tasks/model/moe.py), carved from data parallelism.

As in torchtitan, the dp ranks are split into (dp_rep = dp / ep) × ep with ep innermost (consecutive ranks: one node,
fast links); "dp" stays the flattened pair, so everything that is not an expert shards over all dp ranks as before.
Each routed-expert weight [E, ...] becomes a DTensor Shard(0) over the "ep" axis (rank r of an EP group owns experts
r·E/ep … (r+1)·E/ep − 1) and FSDP2 shards that again over "dp_rep" (2-D, like TP + FSDP). The seeded init, the HF
reader and DCP checkpoints see the full [E, ...] tensor, so EP is a layout like any other.

Tokens travel with two all-to-alls per layer (dispatch, combine), `torch.distributed.all_to_all_single` with uneven
splits (gloo implements it on CPU as alltoall_base), wrapped in an autograd Function whose backward is the reverse
all-to-all. Assignments arrive grouped by source rank, are regrouped by local expert for the grouped matmul, and go
back in the same order.

Gradients: an expert's gradient on its owner sums the contributions of all ep ranks' tokens while FSDP over dp_rep
averages over dp / ep ranks only, so the expert weights' gradient is scaled by 1 / ep in the expert computation —
every layout then reproduces the single-process step (tests/test_moe_train.py). ZeRO 0/1 (replicated parameters,
tasks/parallel/dp.py) average the experts' gradients over "dp_rep" the same way, and ZeRO-1 picks each expert
weight's owner among those replicas (tasks.train.build.dp_replica_groups).

Composition: the mesh is (pp, dp_rep, ep, tp), so each pipeline stage carves its own EP groups from its dp ranks,
and under TP every TP coordinate has its own EP groups: the attention and the shared expert are TP-split, the
routed experts are whole on every TP rank (replicated over tp, as torchtitan without expert-tensor parallelism),
each TP rank dispatches the same tokens within its EP group (tasks/parallel/tp.py).
"""

from __future__ import annotations

import time

import torch

# Wall seconds this process spent inside the all-to-alls (token counts, dispatch, combine; forward and backward),
# for benchmarks; A2A_LOG (a list, when a benchmark sets one) also gets each call's (enter, exit) perf_counter times,
# from which it separates waiting for the peers from the transfer itself.
A2A_SECONDS = [0.0]
A2A_LOG: list | None = None


def _timed_all_to_all(out, x, out_splits, in_splits, group) -> None:
    from tasks import collectives

    t0 = time.perf_counter()
    collectives.all_to_all_single(out, x, out_splits, in_splits, group=group)
    t1 = time.perf_counter()
    A2A_SECONDS[0] += t1 - t0
    if A2A_LOG is not None:
        A2A_LOG.append((t0, t1))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.args = (out_splits, in_splits, group)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        _timed_all_to_all(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.args
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _timed_all_to_all(back, grad.contiguous(), in_splits, out_splits, group)
        return back, None, None, None


def all_to_all(x, out_splits, in_splits, group):
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class AllToAllDispatcher:
    """Sends each assignment row to the EP rank owning its expert, runs the local experts, returns the rows."""

    def __init__(self, group, n_experts: int, ep: int):
        self.group, self.n_experts, self.ep = group, n_experts, ep
        self.local = n_experts // ep

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        ep, local = self.ep, self.local
        counts_in = torch.empty_like(counts)
        _timed_all_to_all(counts_in, counts.contiguous(), None, None, self.group)  # [ep · local]: per source rank
        send = counts.view(ep, local).sum(1).tolist()
        recv_by = counts_in.view(ep, local)  # [source rank, local expert]
        recv = all_to_all(xs, recv_by.sum(1).tolist(), send, self.group)
        # Arrived grouped by (source, expert): regroup by (expert, source) for one grouped matmul per expert.
        sizes = recv_by.flatten().tolist()
        starts = torch.tensor([0] + sizes[:-1]).cumsum(0).view(ep, local)
        perm = (
            torch.cat(
                [
                    torch.arange(int(starts[s, e]), int(starts[s, e]) + int(recv_by[s, e]))
                    for e in range(local)
                    for s in range(ep)
                ]
            )
            if recv.shape[0]
            else torch.zeros(0, dtype=torch.long)
        )
        perm = perm.to(recv.device)
        ys = experts(recv[perm], recv_by.sum(0).tolist())
        back = torch.empty_like(ys).index_copy(0, perm, ys)
        return all_to_all(back, send, recv_by.sum(1).tolist(), self.group)


class EPMesh:
    """The root mesh (pp, dp_rep, ep, tp) plus its flattened "dp" kept by us (torch deprecates slicing a flattened
    dimension from the root): `mesh[name]` as for tasks.parallel.mesh's mesh."""

    def __init__(self, root, dp):
        self.root, self.dp = root, dp

    def __getitem__(self, name):
        return self.dp if name == "dp" else self.root[name]


def build_mesh(device_type: str, pp: int, dp: int, tp: int, ep: int) -> EPMesh:
    """The training mesh with dp split into (dp_rep, ep); "dp" is the flattened pair (tasks.parallel.mesh names
    stay valid)."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(device_type, (pp, dp // ep, ep, tp), mesh_dim_names=("pp", "dp_rep", "ep", "tp"))
    return EPMesh(root, root["dp_rep", "ep"]._flatten("dp"))


def is_expert_param(name: str) -> bool:
    """A routed-expert weight (stacked [E, ...]) by its parameter name."""
    return ".moe.experts." in name.replace("_checkpoint_wrapped_module.", "")


def apply_ep(model, mesh, ep: int) -> None:
    """Experts of every MoE layer: Shard(0) over mesh["ep"], all-to-all dispatch, gradient scaled by 1 / ep.
    Call on the meta model, before FSDP (tasks.parallel.fsdp.apply_fsdp then shards experts over "dp_rep")."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from tasks.model.moe import moe_layers

    ep_mesh = mesh["ep"]
    for _, moe in moe_layers(model):
        ex = moe.experts
        for name, p in list(ex.named_parameters(recurse=False)):
            ex.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
        ex.grad_scale = 1.0 / ep
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.n_experts, ep)


def shard_experts(model, dp_rep_mesh, mp, reshard: bool) -> None:
    """FSDP2 over the replicas of each expert block (before the blocks are wrapped over all of dp)."""
    from torch.distributed.fsdp import fully_shard

    from tasks.model.moe import moe_layers

    for _, moe in moe_layers(model):
        fully_shard(moe.experts, mesh=dp_rep_mesh, mp_policy=mp, reshard_after_forward=reshard)
