"""The collective layer (tasks/collectives.py): one door for every collective of tasks/, and strict mode — each call
held to HCCL's or NCCL's rules as their sources state them (ProcessGroupHCCL.cpp, ProcessGroupNCCL.cpp), on a real
gloo process group. The test session runs in strict hccl mode (conftest), torchrun children included."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tasks import collectives as C

REPO = Path(__file__).resolve().parent.parent

# Files allowed to call torch.distributed collectives directly: none (the trainer, tasks/train/, goes through the
# layer too).
ALLOWED: tuple[str, ...] = ()
COLLECTIVE_NAMES = {
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "scatter",
    "gather",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def direct_collectives(path: Path) -> list[str]:
    """'line: name' of every torch.distributed collective a file uses without the layer (calls and references, via
    `import torch.distributed as X`, `torch.distributed.X`, `from torch.distributed import X` or functional
    collectives)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
            out += [f"{node.lineno}: import {a.name}" for a in node.names if "_functional_collectives" in a.name]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torch.distributed":
                out += [f"{node.lineno}: {a.name}" for a in node.names if a.name in COLLECTIVE_NAMES]
            if "_functional_collectives" in node.module:
                out.append(f"{node.lineno}: from {node.module}")
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVE_NAMES:
            base = ast.unparse(node.value)
            if base in aliases or base == "torch.distributed":
                out.append(f"{node.lineno}: {base}.{node.attr}")
    return sorted(set(out))


def test_every_collective_of_tasks_goes_through_the_layer():
    bad = {}
    for p in sorted((REPO / "tasks").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        if rel == "tasks/collectives.py" or rel.startswith(ALLOWED):
            continue
        if found := direct_collectives(p):
            bad[rel] = found
    assert not bad, f"call tasks.collectives instead of torch.distributed: {bad}"


def test_the_ast_check_sees_each_spelling(tmp_path):
    p = tmp_path / "x.py"
    p.write_text(
        "import torch.distributed as dist\nimport torch\nfrom torch.distributed import send\n"
        "from torch import distributed as d2\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    b = dist.barrier\n"
        "    d2.recv(t, 0)\n    dist.get_rank()\n"
    )
    assert direct_collectives(p) == [
        "3: send",
        "6: dist.all_reduce",
        "7: torch.distributed.barrier",
        "8: dist.barrier",
        "9: d2.recv",
    ]


# --- the rules, each from its source ---------------------------------------------------------------------------


HCCL_CPP, NCCL_CPP, OURS = "ProcessGroupHCCL.cpp", "ProcessGroupNCCL.cpp", "this project's rule"


@pytest.mark.parametrize(
    "backend, op, dtype, refused_by",
    [
        ("hccl", "all_reduce", torch.float32, None),
        ("hccl", "all_reduce", torch.bfloat16, None),
        ("hccl", "all_reduce", torch.int64, None),
        ("hccl", "all_reduce", torch.float64, HCCL_CPP),  # checkSupportedDataType: no fp64 before Ascend950
        ("hccl", "all_reduce", torch.bool, None),  # allreduce's pre-hook casts bool/uint8 to int32
        ("hccl", "reduce_scatter", torch.uint8, HCCL_CPP),  # … reduce_scatter's does not
        ("hccl", "all_gather", torch.uint8, None),  # all-gather/broadcast: any type HCCLUtils maps
        ("hccl", "send", torch.float64, OURS),  # HCCL sends fp64; this project keeps it off the wire
        ("nccl", "all_reduce", torch.float64, None),
        ("nccl", "all_reduce", torch.int16, NCCL_CPP),  # not in NCCLUtils' ncclDataType
        ("nccl", "all_gather", torch.float8_e4m3fn, None),
        ("nccl", "all_reduce", torch.float8_e4m3fn, NCCL_CPP),  # "Float8 dtypes are not currently supported …"
    ],
)
def test_dtype_rules(backend, op, dtype, refused_by):
    why = C.rule_violation(backend, op, torch.zeros(2, dtype=dtype), "cpu")
    assert (why is None) == (refused_by is None), why
    if refused_by:
        assert refused_by in why, why


def test_a_cpu_tensor_on_an_accelerator_run_names_the_call_site():
    """What MoE's CPU float64 statistics would meet on an NPU: HCCL serves npu tensors only."""
    with pytest.raises(C.CollectiveRuleError) as e:
        C.check("all_reduce", [torch.zeros(3)], backend="hccl", device_type="npu")
    line = e.value.__traceback__.tb_lineno  # this test's own line is the call site named
    msg = str(e.value)
    assert "a cpu tensor on a npu run" in msg and "Tensors must be NPU and dense" in msg, msg
    assert f"tests/test_collectives.py:{line} (test_a_cpu_tensor_on_an_accelerator_run_names_the_call_site)" in msg
    assert C.rule_violation("nccl", "broadcast", torch.zeros(2), "cuda").startswith("a cpu tensor on a cuda run")
    assert "contiguous" in C.rule_violation("hccl", "all_reduce", torch.zeros(4, 4).t(), "cpu")


def test_strict_mode_setting(monkeypatch):
    monkeypatch.setenv(C.STRICT_ENV, "HCCL")
    assert C.strict_backend() == "hccl" and C.dist_backend("cpu") == "gloo_as_hccl"
    assert C.dist_backend("npu") == "hccl" and C.dist_backend("cuda") == "nccl"
    monkeypatch.setenv(C.STRICT_ENV, "0")
    assert C.strict_backend() is None and C.dist_backend("cpu") == "gloo"
    C.check("all_reduce", [torch.zeros(1, dtype=torch.float64)])  # not strict: nothing checked
    monkeypatch.setenv(C.STRICT_ENV, "hcl")
    with pytest.raises(ValueError, match="is not one of hccl, nccl"):
        C.strict_backend()


def test_the_test_session_and_its_torchrun_children_are_strict(cfg):
    """conftest sets strict hccl; the train stage hands its environment to torchrun's workers."""
    from tasks.launch import torchrun

    assert os.environ[C.STRICT_ENV] == "hccl"
    assert torchrun.env(cfg, "cpu", 2)[C.STRICT_ENV] == "hccl"


def test_the_gloo_imitation_checks_direct_torch_calls_too(tmp_path, monkeypatch):
    """On CPU, strict mode's process group is gloo behind the checks: a direct torch.distributed call (as FSDP2,
    DTensor or the wave-1 trainer make) is refused with the rule and the call site; good calls go through."""
    monkeypatch.setenv(C.STRICT_ENV, "hccl")
    from tasks.device import dist_backend

    dist.init_process_group(dist_backend("cpu"), store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "gloo_as_hccl"
        t = torch.ones(3)
        C.all_reduce(t)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        out = torch.empty(3)
        dist.all_gather_single(out, t)
        stats = torch.zeros(4, dtype=torch.float64)
        with pytest.raises(C.CollectiveRuleError, match=r"float64 is not supported by HCCL's all_reduce") as e:
            dist.all_reduce(stats)
        assert "tests/test_collectives.py:" in str(e.value)
        with pytest.raises(C.CollectiveRuleError, match="uint8 is not supported by HCCL's reduce_scatter"):
            dist.reduce_scatter_single(torch.empty(2, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8))
    finally:
        dist.destroy_process_group()
