"""Overlapped replicated data parallelism (tasks/parallel/dp.py): gradient buckets all-reduced from backward hooks as
they fill, in the same order on every rank; ZeRO-1's parameter broadcast coalesced into buckets. One gloo process
(the averages of real replicas are the layout-parity tests' job: tests/test_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tasks import collectives
from tasks.parallel import dp


@pytest.fixture
def group(tmp_path):
    from tasks.device import dist_backend

    dist.init_process_group(dist_backend("cpu"), store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def _record(monkeypatch, name):
    calls, real = [], getattr(collectives, name)

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(collectives, name, spy)
    return calls


def test_buckets_are_reduced_during_backward_in_order(group, monkeypatch):
    model = _model()
    params = list(model.parameters())
    # ~2 layers per bucket: the last layer's gradients come first in backward, so they fill the first bucket.
    reducer = dp.GradBuckets(params, group, size=2, accumulations=2, scale=0.5, first_bytes=33_000, bytes_=33_000)
    assert [len(b) for b in reducer.buckets] == [4, 4]
    assert reducer.params[0] is params[-1]  # reverse order of definition: backward's order
    launched = _record(monkeypatch, "all_reduce")
    x = torch.randn(8, 64)
    model(x).square().mean().backward()
    assert launched == []  # first of two micro-batches: nothing is final yet
    model(x).square().mean().backward()
    assert len(launched) == 2 and reducer.next == 2  # both buckets went out from the hooks, before finish()
    want = [p.grad.clone() * 0.5 / 2 for p in params]  # one rank: the sum is its own; × scale / size
    reducer.finish()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
    assert reducer.next == 0 and reducer.inflight == []  # ready for the next step
    # A gradient accumulated after its bucket left would be missing from the average: refused, not averaged.
    for _ in range(3):
        model(x).sum().backward()
    with pytest.raises(RuntimeError, match="accumulated 3 times in one step, 2 expected"):
        reducer.finish()


def test_finish_launches_what_backward_did_not(group, monkeypatch):
    model = _model()
    reducer = dp.GradBuckets(list(model.parameters()), group, size=1, first_bytes=33_000, bytes_=33_000)
    launched = _record(monkeypatch, "all_reduce")
    # layers 1-3 only: the first bucket (layers 3, 2) fills; the second (1, 0) never does, layer 0 gets no gradient
    model[3](model[2](model[1](torch.randn(2, 64)))).sum().backward()
    assert len(launched) == 1
    reducer.finish()
    assert launched == [launched[0], 64 * 64 + 64]  # layer 1's gradients, sent by finish()
    assert model[0].weight.grad is None


def test_zero1_broadcast_is_one_collective_per_bucket(group, monkeypatch):
    model = _model()
    named = list(model.named_parameters())
    sent = _record(monkeypatch, "broadcast")
    before = [p.detach().clone() for _, p in named]
    dp.broadcast_params(named, {n: 0 for n, _ in named}, group, bytes_=2 * (64 * 64 + 64) * 4)
    # 8 parameters of 4 layers in buckets of ~2 layers: 2 collectives, not 8
    assert len(sent) == 2 and sum(sent) == sum(p.numel() for _, p in named)
    for (_, p), b in zip(named, before):
        torch.testing.assert_close(p, b)


def test_a_bucket_sent_by_finish_is_scaled_once(group):
    """A pipeline schedule scales the gradients (1/micro-batches) after its last backward, before finish(): a bucket
    the hooks sent carries the unscaled sum (× scale on the way back), one that finish() sends carries the scaled one
    (never × scale again). Here layer 2 sat out the second micro-batch: layers 1 and 0 wait behind it."""
    model = _model()
    params = list(model.parameters())
    reducer = dp.GradBuckets(params, group, size=1, accumulations=2, scale=0.5, first_bytes=16_000, bytes_=16_000)
    assert [len(b) for b in reducer.buckets] == [2, 2, 2, 2]  # one layer (weight, bias) per bucket, layer 3 first
    x = torch.randn(8, 64)
    model(x).square().mean().backward()
    model[3](torch.relu(model[1](model[0](x)))).sum().backward()  # layer 2 sits out: 1 of 2 accumulations
    assert reducer.next == 1  # layer 3 sent from its hook; layer 2 never completes, so 1 and 0 wait for finish()
    for p in params:  # what the schedule does at the end of its step (scale_grads: 1 / micro-batches)
        if p.grad is not None:
            p.grad.mul_(0.5)
    want = [p.grad.clone() for p in params]  # one rank: the average is its own, scaled once
    reducer.finish()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
