"""Advisor rules over the unified report: each finding has a rule id, a severity, the evidence numbers and advice.

Thresholds: msprof-analyze's advisor (Ascend/msprof-analyze, `msprof_analyze/advisor`) where it has one — slow
rank / slow link at (max − min) / mean > 5 % (analyzer/cluster/slow_rank_analyzer.py RATIO_THRESHOLD,
slow_link_analyzer.py), AI CPU tasks > 20 µs (computation/aicpu/aicpu_checker.py _MIN_TASK_DURATION), data loader
> 10 000 µs per step (rules/en/dataloader.yaml). The AllReduce share has no advisor threshold; this project's rule
of thumb fires at 30 % of the step (communication.allreduce, medium/high) and keeps a low-severity note from 25 %
(communication.allreduce_note).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

THRESHOLDS = {
    "busy_min": 0.50,  # device busy (1 − free) below this share of the step → under-utilised
    "comm_not_overlapped_max": 0.30,  # exposed communication above this share of the step
    "allreduce_max": 0.30,  # AllReduce time above this share of the step: the rule (rule of thumb, 30 %)
    "allreduce_note": 0.25,  # between this and allreduce_max: a low-severity note (25 %)
    "spread_max": 0.05,  # slow rank / slow link: (max − min) / mean
    "spread_min_share": 0.05,  # ignore a dimension smaller than this share of the step (noise, not a rank)
    "ai_cpu_max_us": 20.0,
    "bubble_max": 0.10,  # pipeline bubble above this share of the step
    "data_wait_max_us": 10_000.0,
}


@dataclass
class Finding:
    rule: str
    severity: str  # high | medium | low
    title: str
    evidence: dict
    advice: str

    def to_dict(self) -> dict:
        return asdict(self)


NPU_FORMATS = ("ascend_pt", "msprof", "cluster_analysis")  # Ascend producers: torch_npu, msprof, msprof-analyze


def device_kind(report: dict) -> str:
    """npu (an Ascend format), else cuda when the torch trace holds GPU kernels, else cpu: which device's advice
    (npu-smi, nvidia-smi, the host) and which device-only rules (AI Core cube/vector) apply."""
    if (report.get("source") or {}).get("format") in NPU_FORMATS:
        return "npu"
    return "cuda" if any(o["core"] == "CUDA" for o in report.get("top_ops") or []) else "cpu"


_SLOW_RANK_CHECK = {
    "npu": "check that card (npu-smi info: temperature, frequency, HBM)",
    "cuda": "check that GPU (nvidia-smi -q -d TEMPERATURE,CLOCK,PERFORMANCE: thermal or power throttling, clocks)",
    "cpu": "check that rank's host (CPU load from other processes, frequency scaling, its cores and NUMA binding)",
}
_SLOW_LINK_CHECK = {
    "npu": "hccn_tool link status / optical modules for RDMA, HCCS topology (npu-smi info -t topo)",
    "cuda": "nvidia-smi topo -m (NVLink/PCIe path), the NICs NCCL uses (NCCL_DEBUG=INFO)",
    "cpu": "the network between the hosts (the interface gloo uses, GLOO_SOCKET_IFNAME)",
}


def _sev(ratio: float) -> str:
    """How far past its threshold a value is: twice or more is high."""
    return "high" if ratio >= 2.0 else "medium"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def advise(report: dict, thresholds: dict | None = None) -> list[dict]:
    t = {**THRESHOLDS, **(thresholds or {})}
    out: list[Finding] = []
    step = report["step"]
    shares = step["shares"]
    if shares["busy"] < t["busy_min"]:
        out.append(
            Finding(
                "utilisation.low",
                "high" if shares["busy"] < t["busy_min"] / 2 else "medium",
                f"device busy only {_pct(shares['busy'])} of the step",
                {"busy_share": shares["busy"], "free_us": step["free_us"], "step_us": step["step_us"]},
                "The device idles between operators: check data-loader wait, host-bound dispatch (on NPU: graph mode / "
                "torch.compile, TASK_QUEUE_ENABLE=2, fewer small ops via fused operators) and a larger micro-batch.",
            )
        )
    if shares["comm_not_overlapped"] > t["comm_not_overlapped_max"]:
        out.append(
            Finding(
                "communication.not_overlapped",
                _sev(shares["comm_not_overlapped"] / t["comm_not_overlapped_max"]),
                f"communication not overlapped with compute takes {_pct(shares['comm_not_overlapped'])} of the step",
                {
                    "comm_not_overlapped_share": shares["comm_not_overlapped"],
                    "comm_not_overlapped_us": step["comm_not_overlapped_us"],
                    "overlapped_us": step["overlapped_us"],
                    "step_us": step["step_us"],
                },
                "Change the parallel plan (keep TP inside a node, trade TP for DP/ZeRO or PP), raise gradient "
                "accumulation so each sync carries more compute, and check the network (slow links, HCCS/RDMA "
                "bandwidth).",
            )
        )
    if step["allreduce_share"] > t["allreduce_max"]:
        out.append(
            Finding(
                "communication.allreduce",
                _sev(step["allreduce_share"] / t["allreduce_max"]),
                f"AllReduce takes {_pct(step['allreduce_share'])} of the step",
                {"allreduce_share": step["allreduce_share"], "allreduce_us_per_step": step["allreduce_us_per_step"]},
                "Gradient AllReduce dominates: raise gradient accumulation, use ZeRO/FSDP (reduce-scatter overlapped "
                "with backward), or move TP off the inter-node links.",
            )
        )
    elif step["allreduce_share"] > t["allreduce_note"]:
        out.append(
            Finding(
                "communication.allreduce_note",
                "low",
                f"AllReduce takes {_pct(step['allreduce_share'])} of the step (above {_pct(t['allreduce_note'])}, "
                f"below the {_pct(t['allreduce_max'])} rule)",
                {"allreduce_share": step["allreduce_share"], "allreduce_us_per_step": step["allreduce_us_per_step"]},
                "Worth watching as the model or world grows: gradient accumulation and ZeRO/FSDP keep the AllReduce "
                "share down.",
            )
        )
    out += _slow(report, t)
    for op in report["ai_cpu_ops"]:
        if op["max_us"] > t["ai_cpu_max_us"]:
            out.append(
                Finding(
                    "operator.ai_cpu",
                    "medium",
                    f"AI CPU operator {op['name']} runs up to {op['max_us']:.0f} µs",
                    {"op": op["name"], "max_us": op["max_us"], "count": op["count"], "total_us": op["total_us"]},
                    "AI CPU operators run on the host-side CPU cores: change the dtype (e.g. int64/double → "
                    "int32/float) "
                    "or the call so the AI Core kernel is chosen (msprof-analyze advisor aicpu rules list them).",
                )
            )
    if shares["bubble"] > t["bubble_max"]:
        out.append(
            Finding(
                "pipeline.bubble",
                _sev(shares["bubble"] / t["bubble_max"]),
                f"pipeline bubble is {_pct(shares['bubble'])} of the step",
                {"bubble_share": shares["bubble"], "bubble_us": step["bubble_us"], "step_us": step["step_us"]},
                "Raise the number of micro-batches per step, or use the interleaved 1F1B schedule (virtual stages).",
            )
        )
    wait = report.get("data_wait")
    if wait and wait["max_us_per_step"] > t["data_wait_max_us"]:
        out.append(
            Finding(
                "data.wait",
                _sev(wait["max_us_per_step"] / t["data_wait_max_us"]),
                f"data loading blocks {wait['max_us_per_step'] / 1000:.1f} ms per step",
                {"max_us_per_step": wait["max_us_per_step"], "by_rank_us_per_step": wait["by_rank_us_per_step"]},
                "Raise data.loader_workers and prefetching, pin memory, and keep shards on local disk.",
            )
        )
    return [f.to_dict() for f in out]


def _slow(report: dict, t: dict) -> list[Finding]:
    slow = report.get("slow_ranks") or {}
    out = []
    step_us = report["step"]["step_us"] or 1.0
    dims = {
        d: v
        for d, v in (slow.get("dims") or {}).items()
        if v["spread"] > t["spread_max"] and v["mean_us"] / step_us >= t["spread_min_share"]
    }
    kind = device_kind(report)
    if dims:
        worst = max(v["spread"] for v in dims.values())
        spreads = ", ".join(f"{d} spread {_pct(v['spread'])}" for d, v in dims.items())
        out.append(
            Finding(
                "cluster.slow_rank",
                _sev(worst / t["spread_max"]),
                f"rank {slow['slowest_rank']} is slow: {spreads}",
                {
                    "slowest_rank": slow["slowest_rank"],
                    **{f"{d}_spread": v["spread"] for d, v in dims.items()},
                    **{f"{d}_by_rank_us": v["by_rank_us"] for d, v in dims.items()},
                },
                f"The other ranks wait for it in every collective: {_SLOW_RANK_CHECK[kind]}, its data shard sizes, "
                "and uneven pipeline stages or layer split.",
            )
        )
    for transport, v in (slow.get("links") or {}).items():
        if v["spread"] > t["spread_max"]:
            worst_rank = min(v["by_rank_gbps"], key=v["by_rank_gbps"].get)
            out.append(
                Finding(
                    "cluster.slow_link",
                    _sev(v["spread"] / t["spread_max"]),
                    f"{transport} bandwidth differs by {_pct(v['spread'])} across ranks (rank {worst_rank} slowest)",
                    {"transport": transport, "spread": v["spread"], "by_rank_gbps": v["by_rank_gbps"]},
                    f"Check that link: {_SLOW_LINK_CHECK[kind]}; run the env stage's bandwidth probe.",
                )
            )
    return out
