"""Cluster presets for the planner: devices per node, memory, link bandwidths (GB/s, 1e9 bytes/s), peak FLOP/s.

Figures are nominal vendor numbers; every one can be overridden (hardware.* in the config, or the plan flags).
Memory is the nominal capacity in decimal GB, so a "64 GB" card (64 GiB = 68.7e9 bytes) keeps ~7 % headroom beyond
the runtime reserve. Bandwidths are per device and per direction, the β of the ring formulas in planner.search.

- 910b (Atlas 800T A2, Ascend 910B2/B3): 8 NPUs per node, 64 GB HBM each. Inside a node the NPUs form a full mesh of
  HCCS links, 7 per NPU at 56 GB/s each (392 GB/s per NPU in aggregate). A ring step uses one neighbour link, so we
  take the per-link 56 GB/s (conservative for HCCL's mesh algorithms; the env stage's bus-bandwidth probe expects
  this preset's link figure, tasks.envcheck.probe.expected_bus). Across nodes each NPU has its own 200 Gb/s RoCE
  port: 25 GB/s. Dense FP16/BF16 peak ~313 TFLOP/s (the commonly quoted 910B figure; a 910B2 is sometimes quoted
  higher, set hardware.peak_tflops if yours is).
- 910c (Atlas A3 / CloudMatrix384; Zuo et al. 2025, arXiv:2506.12708 §3): a 910C is two dies, each seen by
  torch_npu as one device with 64 GB of the package's 128 GB HBM and 376 TFLOP/s FP16; 16 devices per node; each
  die has 7 × 224 Gb/s UB links (196 GB/s) for scale-up and a 200 Gb/s RDMA port (25 GB/s) for scale-out.
- a100-80g (DGX A100): NVLink 3 600 GB/s bidirectional = 300 GB/s per direction through NVSwitch; 8 × HDR
  200 Gb/s (25 GB/s per GPU); 312 TFLOP/s dense BF16 (A100 datasheet).
- h100-80g (DGX H100, SXM): NVLink 4 900 GB/s bidirectional = 450 GB/s per direction; 8 × NDR 400 Gb/s (50 GB/s per
  GPU); 989 TFLOP/s dense BF16 (H100 datasheet).
- cpu-laptop: the CI demo, 2 gloo processes on one machine; rough memcpy-bound gloo and 1 Gb/s Ethernet figures;
  0.037 TFLOP/s per rank, one core's fp32 matmul rate as once measured for a 1024² matmul (bench_train_step's
  cpu_matmul_peak_gflops now takes the best of 256²/512² matmuls: 88.8 GF/s in bench/results.json; the preset keeps
  the 1024² figure, a conservative one, so the planner's estimates stay comparable).

Collective latency (α of the α-β model: the fixed cost of one collective call — launch, the peers' handshake, the
first byte — paid however small the message; bytes / bandwidth is β's part). Accelerator collectives cost tens of
µs per call at the smallest sizes (HCCL/NCCL launch plus link latency); the presets take 20 µs inside a node
(HCCS / NVLink) and 30 µs across nodes (RoCE / InfiniBand) as nominal figures — measure yours with hccl_test /
nccl-tests at their smallest data_size (`aveg_time`) and set hardware.intra_node_latency_us /
inter_node_latency_us. cpu-laptop: 100 µs, the median of a 1 KB `all_to_all_single` between 2 gloo processes over
loopback on this repository's 2-core machine (bench/bench_moe.py measures it again: moe.gloo_all_to_all_latency_us).

Runtime reserve (memory the framework never sees): CANN + HCCL + driver take ~5 GB per NPU (MindSpeed auto_settings,
static_mem_modeling.py: 5000 MB "cann+hccl+driver+os"); a CUDA context + NCCL ~1 GB. On CPU (gloo) 0.12 GB,
measured: a training rank's RSS grows by that much over what it held before the model existed even for a model whose
tensors are negligible (the debug preset, 14 MB estimated, dp 2 ZeRO-3, seq 128: 134–137 MB held in the training
phase; the demo preset: 172–174 MB held for 47 MB estimated). Of it, ≈ 50 MB are the modules the worker imports
while building the parallel model (FSDP2, DTensor TP, DCP), ≈ 5 MB the mesh's gloo groups, the rest the first
training step's runtime (autograd and gloo threads' malloc arenas, kernel caches). On an accelerator the allocator's
figures never include the reserve; on CPU the RSS does, so the trainer adds it to the estimate it compares
(tasks/stages/train.py _estimate). CPU ranks are forked by tasks/launch/agent.py after those modules are imported;
it keeps the figure an exec'd rank's (their RSS stays the first trainer's, PhasePeaks): the failing-rehearsal run's
ranks held 181 and 134 MB forked, 179 and 132 MB exec'd.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tasks.errors import ConfigError

RESERVE_GB = {"npu": 5.0, "cuda": 1.0, "cpu": 0.12}


@dataclass(frozen=True)
class Cluster:
    name: str
    kind: str  # npu | cuda | cpu
    nodes: int
    devices_per_node: int
    memory_gb: float
    intra_gbps: float  # GB/s per device inside a node
    inter_gbps: float  # GB/s per device between nodes
    peak_tflops: float  # dense 16-bit (fp32 at a fraction: search.achieved_flops); a CPU's: its fp32 rate
    reserve_gb: float
    intra_latency_us: float = 20.0  # one collective call's fixed cost inside a node (α)
    inter_latency_us: float = 30.0  # … across nodes

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} × {self.devices_per_node} devices, {self.memory_gb:g} GB each, "
            f"{self.intra_gbps:g}/{self.inter_gbps:g} GB/s intra/inter, {self.peak_tflops:g} TFLOP/s"
        )


@dataclass(frozen=True)
class Device:
    """One accelerator's nominal figures: the rows both the cluster presets and the trainer's MFU read."""

    match: tuple[str, ...]  # substrings of the runtime device name (torch.cuda / torch_npu get_device_name)
    memory_gb: float  # per device, decimal GB
    peak_tflops: float  # dense 16-bit


# The one table of device peaks and memory (sources in the module docstring). torch_npu names a 910C die
# "Ascend910_93xx" (the A3 SoC; see tasks.device._FUSED_ATTENTION_SOC).
DEVICES = {
    "910b": Device(("910B",), 64.0, 313.0),
    "910c": Device(("910C", "910_93"), 64.0, 376.0),
    "a100-80g": Device(("A100",), 80.0, 312.0),
    "h100-80g": Device(("H100",), 80.0, 989.0),
    "h200": Device(("H200",), 141.0, 989.0),  # H200 datasheet: H100's compute, 141 GB HBM3e
    # one rank's core: its fp32 matmul rate, 37.2 GF/s once measured for a 1024² fp32 matmul on one thread of this
    # repository's 2-core host (train_step.cpu_matmul_peak_gflops now reports 256²/512²'s best, 88.8; a CPU's bf16 is
    # no faster)
    "cpu-laptop": Device((), 8.0, 0.037),
}


def device_peak_tflops(device_name: str) -> float | None:
    """The DEVICES row whose name matches a runtime device name ('NVIDIA H100 80GB HBM3', 'Ascend910B2'), or None."""
    return next((d.peak_tflops for d in DEVICES.values() if any(m in device_name for m in d.match)), None)


def _preset(
    name: str,
    kind: str,
    devices_per_node: int,
    intra_gbps: float,
    inter_gbps: float,
    intra_latency_us: float = 20.0,
    inter_latency_us: float = 30.0,
) -> Cluster:
    d = DEVICES[name]
    return Cluster(
        name,
        kind,
        1,
        devices_per_node,
        d.memory_gb,
        intra_gbps,
        inter_gbps,
        d.peak_tflops,
        RESERVE_GB[kind],
        intra_latency_us,
        inter_latency_us,
    )


PRESETS = {
    "910b": _preset("910b", "npu", 8, 56.0, 25.0),
    "910c": _preset("910c", "npu", 16, 196.0, 25.0),
    "a100-80g": _preset("a100-80g", "cuda", 8, 300.0, 25.0),
    "h100-80g": _preset("h100-80g", "cuda", 8, 450.0, 50.0),
    "cpu-laptop": _preset("cpu-laptop", "cpu", 2, 2.0, 0.125, 100.0, 200.0),
}


def get_cluster(
    name: str,
    nodes: int = 0,
    devices_per_node: int = 0,
    memory_gb: float = 0.0,
    intra_gbps: float = 0.0,
    inter_gbps: float = 0.0,
    peak_tflops: float = 0.0,
    reserve_gb: float = 0.0,
    intra_latency_us: float = 0.0,
    inter_latency_us: float = 0.0,
) -> Cluster:
    """A preset with every non-zero override applied."""
    if name not in PRESETS:
        raise ConfigError(f"hardware.cluster: unknown cluster {name!r} (known: {', '.join(PRESETS)})")
    overrides = {
        "nodes": nodes,
        "devices_per_node": devices_per_node,
        "memory_gb": memory_gb,
        "intra_gbps": intra_gbps,
        "inter_gbps": inter_gbps,
        "peak_tflops": peak_tflops,
        "reserve_gb": reserve_gb,
        "intra_latency_us": intra_latency_us,
        "inter_latency_us": inter_latency_us,
    }
    bad = [f"{k}: {v} must be >= 0" for k, v in overrides.items() if v < 0]
    if bad:
        raise ConfigError(bad)
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v})
