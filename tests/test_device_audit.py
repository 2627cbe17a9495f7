"""Device rules a CPU run cannot show, held by code CPU tests exercise (audit of tasks/collectives.py and the torch_npu
names the project reaches dynamically). Cheap: function-level, one in-process gloo group of one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tasks import collectives as C

REPO = Path(__file__).resolve().parent.parent


# --- complex tensors: torch.distributed views them as real before the backend (distributed_c10d.py) ---------------


@pytest.mark.parametrize("backend", ["hccl", "nccl"])
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "all_to_all", "send", "recv"])
def test_complex64_is_sent_as_float32_where_torch_views_it_as_real(backend, op):
    assert C.rule_violation(backend, op, torch.zeros(2, dtype=torch.complex64), "cpu") is None


def test_complex_keeps_its_own_dtype_where_torch_does_not_view_it():
    why = C.rule_violation("hccl", "reduce_scatter", torch.zeros(2, dtype=torch.complex64), "cpu")
    assert why and "complex64 is not supported by HCCL's reduce_scatter" in why, why
    why = C.rule_violation("hccl", "all_reduce", torch.zeros(2, dtype=torch.complex128), "cpu")
    assert why and "sent as torch.float64" in why and "ProcessGroupHCCL.cpp" in why, why
    assert "float64 on the wire" in C.rule_violation("hccl", "send", torch.zeros(2, dtype=torch.complex128), "cpu")


def test_nccl_views_complex_as_real_in_reduce_scatter_too():
    """H200, torch 2.11.0+cu130 (device audit 2026-12): reduce_scatter_tensor of complex64 runs on NCCL."""
    assert C.rule_violation("nccl", "reduce_scatter", torch.zeros(2, dtype=torch.complex64), "cpu") is None
    assert C.rule_violation("nccl", "reduce_scatter", torch.zeros(2, dtype=torch.complex32), "cpu") is None


def test_contiguity_in_the_suggested_memory_format_under_nccl():
    """The same H200 run: NCCL all-reduces a channels_last tensor and refuses a transposed one."""
    cl = torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert C.rule_violation("nccl", "all_reduce", cl, "cpu") is None
    assert "contiguous" in C.rule_violation("hccl", "all_reduce", cl, "cpu")  # HCCL: no evidence, kept strict
    for backend in ("hccl", "nccl"):
        assert "Tensors must be contiguous" in C.rule_violation(backend, "all_reduce", torch.ones(3, 4).t(), "cpu")


def test_the_device_rule_quotes_what_torch_says():
    """The H200 run: a CPU tensor on an NCCL group fails in torch's dispatch with this text."""
    why = C.rule_violation("nccl", "all_reduce", torch.ones(2), "cuda")
    assert 'No backend type associated with device type cpu"' in why, why


def test_the_layer_and_the_imitated_group_agree_on_complex(tmp_path, monkeypatch):
    """The same complex64 all_reduce through tasks.collectives and through torch.distributed directly (gloo_as_hccl):
    both pass, as on a real HCCL group; a complex128 one is refused by both (float64 on the wire)."""
    monkeypatch.setenv(C.STRICT_ENV, "hccl")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(C.dist_backend("cpu"), store=store, rank=0, world_size=1)
    try:
        t = torch.ones(2, dtype=torch.complex64)
        C.all_reduce(t)
        dist.all_reduce(t)
        assert t.tolist() == [1 + 0j, 1 + 0j]
        for call in (C.all_reduce, dist.all_reduce):
            with pytest.raises(C.CollectiveRuleError, match="float64"):
                call(torch.ones(2, dtype=torch.complex128))
        # object collectives: torch pickles into uint8 / int64 tensors on the group's device — allowed
        out = [None]
        C.all_gather_object(out, {"a": 1})
        objs = [{"b": 2}]
        C.broadcast_object_list(objs, src=0)
        assert out == [{"a": 1}] and objs == [{"b": 2}]
    finally:
        dist.destroy_process_group()


# --- dense: every sparse layout, one line (a CSR tensor's is_contiguous() raises) ---------------------------------


@pytest.mark.parametrize("backend", ["hccl", "nccl"])
def test_every_sparse_layout_is_refused_in_one_line(backend):
    for t in (torch.eye(3).to_sparse(), torch.eye(3).to_sparse_csr(), torch.eye(3).to_sparse_csc()):
        why = C.rule_violation(backend, "all_gather", t, "cpu")
        assert why and "and dense" in why and "to_dense()" in why, (t.layout, why)


# --- every direct torch.distributed entry point reaches the imitation's checks -------------------------------------


def test_each_direct_entry_point_is_checked(tmp_path, monkeypatch):
    """fp64 through each torch.distributed collective a world of one can issue: the imitated HCCL group refuses
    every one (a `_check` dropped from a _CheckedGloo method turns this red)."""
    monkeypatch.setenv(C.STRICT_ENV, "hccl")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(C.dist_backend("cpu"), store=store, rank=0, world_size=1)
    f64 = torch.ones(2, dtype=torch.float64)
    calls = {
        "broadcast": lambda: dist.broadcast(f64, src=0),
        "all_reduce": lambda: dist.all_reduce(f64),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([f64]),
        "reduce": lambda: dist.reduce(f64, dst=0),
        "all_gather": lambda: dist.all_gather([torch.empty_like(f64)], f64),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty_like(f64), f64),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty_like(f64), f64),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(f64), f64),
        "all_to_all": lambda: dist.all_to_all([torch.empty_like(f64)], [f64]),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty_like(f64), [f64]),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([[torch.empty_like(f64)]], [f64]),
    }
    try:
        passed = []
        for name, call in calls.items():
            try:
                call()
                passed.append(name)
            except C.CollectiveRuleError as e:
                assert "float64" in str(e), (name, e)
        assert not passed, f"fp64 reached gloo unchecked through {passed}"
    finally:
        dist.destroy_process_group()


# --- torch_npu names the project reaches by string (the AST walk of test_npu_api cannot see them) --------------------


def test_dynamically_named_npu_ops_exist_in_every_pinned_torch_npu():
    from tasks.model.npu_kernels import KERNELS
    from tasks.parallel.ac import NPU_ATTENTION_OPS

    snaps = sorted((REPO / "tests" / "fixtures" / "npu_api").glob("torch_npu-*.json"))
    assert len(snaps) >= 2
    for snap in snaps:
        ops = json.loads(snap.read_text(encoding="utf-8"))["ops"]
        for name in (*KERNELS.values(), *NPU_ATTENTION_OPS):
            assert name in ops, f"{snap.name}: torch_npu has no {name}"
