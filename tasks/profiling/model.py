"""What every reader produces: per-rank step breakdowns, operators, communication ops, data wait, memory.

Times are microseconds (the unit of every Ascend CSV and of Chrome traces) unless a name says otherwise.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field


@dataclass
class Step:
    """One step of one rank, split the way Ascend's overlap analysis splits it (step_trace_time.csv)."""

    step: int | None
    computing: float
    comm_not_overlapped: float
    overlapped: float
    communication: float
    free: float
    bubble: float = 0.0
    preparing: float = 0.0

    @property
    def total(self) -> float:
        # Computing ∪ Communication ∪ Free tiles the step: the three parts sum to its wall time (= Stage + Bubble).
        return self.computing + self.comm_not_overlapped + self.free


@dataclass
class Op:
    """One operator type on one rank, aggregated over the profiled steps."""

    name: str
    core: str  # Accelerator Core / Core Type on Ascend (AI_CORE, AI_CPU, …); "CPU" / "CUDA" for torch
    count: int
    total_us: float
    max_us: float

    @property
    def category(self) -> str:
        return categorize(self.name, self.core)


@dataclass
class CommOp:
    """One collective or P2P op from communication.json (ms, as Ascend writes them)."""

    name: str
    kind: str  # collective | p2p
    elapse_ms: float
    transit_ms: float
    wait_ms: float
    bandwidth: dict = field(default_factory=dict)  # transport (RDMA, HCCS, SDMA, …) → (size MB, time ms)


@dataclass
class RankData:
    rank: int
    origin: str  # the folder or file it came from
    steps: list[Step] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    comm_ops: list[CommOp] = field(default_factory=list)
    data_wait_us: list[float] = field(default_factory=list)  # per step, when the trace shows it
    memory_peak_mb: dict = field(default_factory=dict)  # allocated / reserved


@dataclass
class Profile:
    path: str
    fmt: str  # ascend_pt | msprof | cluster_analysis | torch_trace
    ranks: list[RankData]
    variants: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


CATEGORIES = ("cube/matmul", "attention", "vector", "ai_cpu", "communication")

# Collectives by their producers' names (HCCL hcom_*, NCCL kernels, gloo/c10d ops, functional collectives); a
# bare "broadcast" is not one (aten::broadcast_tensors is a view).
_COMM = re.compile(
    r"^hcom_|hccl|nccl|^gloo:|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|"
    r"all_?to_?all|batch_?send_?recv|^(send|recv|receive)$",
    re.I,
)
_ATTENTION = re.compile(r"attention|flash|sdpa|scaled_dot_product|softmax_?v?2?.*attn", re.I)
_CUBE = re.compile(
    r"matmul|gemm|\bmm\b|aten::(mm|bmm|addmm|linear|matmul|baddbmm|conv\w*)$|conv\d?d|batchmatmul|"
    r"quantbatchmatmul|groupedmatmul",
    re.I,
)


@functools.lru_cache(maxsize=1 << 16)  # a trace repeats a few hundred names over its ~100k events
def categorize(name: str, core: str = "") -> str:
    """cube/matmul, attention, vector, ai_cpu or communication — by the core type first, then the name."""
    core_u = (core or "").upper()
    if core_u in ("COMMUNICATION", "HCCL") or _COMM.search(name):
        return "communication"
    if core_u == "AI_CPU" or "aicpu" in name.lower():  # Level0 kernel_details leave the core N/A; names keep it
        return "ai_cpu"
    if _ATTENTION.search(name):
        return "attention"
    if _CUBE.search(name):
        return "cube/matmul"
    return "vector"


def is_allreduce(name: str) -> bool:
    return bool(re.search(r"all_?reduce", name, re.I))


def is_all_to_all(name: str) -> bool:
    """Expert parallelism's token dispatch/combine (gloo alltoall_base, HCCL alltoallv, NCCL all_to_all)."""
    return bool(re.search(r"all_?to_?all", name, re.I))
