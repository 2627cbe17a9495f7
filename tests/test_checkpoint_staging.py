"""The staging copy of asynchronous checkpoints (tasks/parallel/checkpoint.BufferStager): a snapshot of the state as
of the save that later training does not change, in host buffers reused from one save to the next, written by DCP
into a checkpoint that loads back the staged values (DTensors included). One gloo process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    from tasks.device import dist_backend

    dist.init_process_group(dist_backend("cpu"), store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _state(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    return {
        "model": {"w": distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]), "b": torch.randn(3)},
        "optim": {"state.w.step": torch.tensor(2.0), "param_groups.w.lr": 0.1, "param_groups.w.betas": (0.9, 0.95)},
    }


def test_staged_copy_is_a_snapshot_in_reused_buffers(mesh, tmp_path):
    import torch.distributed.checkpoint as dcp

    from tasks.parallel.checkpoint import BufferStager

    state, stager = _state(mesh), BufferStager()
    first = stager.stage(state)
    want = {"w": state["model"]["w"].full_tensor().clone(), "b": state["model"]["b"].clone()}
    with torch.no_grad():  # training goes on: the live state changes, the staged copy must not
        state["model"]["w"].mul_(-1)
        state["model"]["b"].add_(1)
        state["optim"]["state.w.step"].add_(1)
    assert torch.equal(first["model"]["w"].full_tensor(), want["w"])
    assert torch.equal(first["model"]["b"], want["b"]) and first["optim"]["state.w.step"].item() == 2.0
    assert first["optim"]["param_groups.w.lr"] == 0.1 and first["optim"]["param_groups.w.betas"] == (0.9, 0.95)

    state["optim"]["param_groups.w.lr"] = 0.05  # the schedule moved: a leaf, not a new structure
    second = stager.stage(state)
    assert second["model"]["b"].data_ptr() == first["model"]["b"].data_ptr()  # the same buffers, new values
    assert torch.equal(second["model"]["w"].full_tensor(), -want["w"]) and second["optim"]["state.w.step"].item() == 3
    assert second["optim"]["param_groups.w.lr"] == 0.05

    dcp.save(second, checkpoint_id=str(tmp_path / "ckpt"))
    back = _state(mesh)
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt"))
    assert torch.equal(back["model"]["w"].full_tensor(), -want["w"]) and torch.equal(back["model"]["b"], want["b"] + 1)

    state["model"]["b"] = torch.randn(5)  # another shape: new buffers, never a copy into the old ones
    third = stager.stage(state)
    assert third["model"]["b"].shape == (5,) and torch.equal(third["model"]["b"], state["model"]["b"])
