"""Second wave of the guides' profile rules, over the unified report (same Finding shape as advisor.py):

- compute.cube_vector_imbalance: of AI Core time, cube (matmul/attention) vs vector operators; one side above
  msprof-analyze's operator-bound ratio 0.8 (config.ini operator_bound_ratio) means the other unit idles. Ascend
  operator data only (torch_npu, msprof): CPU and CUDA traces have no AI Core.
- scaling.communication_headroom (info): communication below 15 % of the step → adding cards is fine (the guides'
  scaling rule of thumb); above it, more cards mostly add communication.
- communication.retransmission: a collective whose average transit exceeds 4000 ms (msprof-analyze
  rules/en/rdma_analysis.yaml: a single transmission > 4000 ms means RDMA retransmission).
- operator.ai_cpu_list (info): every AI CPU operator by name (operator.ai_cpu flags only those > 20 µs).
Severity "info" never warns the stage.
"""

from __future__ import annotations

from tasks.profiling.advisor import Finding, advise

AI_CORE_FORMATS = ("ascend_pt", "msprof")  # per-operator tables of an Ascend device (AI Core: cube and vector units)

THRESHOLDS = {
    "bound_ratio": 0.80,  # msprof-analyze config.ini operator_bound_ratio
    "comm_headroom_max": 0.15,  # communication share below which adding cards is fine
    "retransmission_ms": 4000.0,  # rules/en/rdma_analysis.yaml
    "min_compute_share": 0.05,  # ignore the cube/vector split when AI Core time is this small a share
}


def guide_rules(report: dict, thresholds: dict | None = None) -> list[dict]:
    t = {**THRESHOLDS, **(thresholds or {})}
    out: list[Finding] = []
    cats = report.get("categories") or {}
    cube = cats.get("cube/matmul", {}).get("total_us", 0.0) + cats.get("attention", {}).get("total_us", 0.0)
    vector = cats.get("vector", {}).get("total_us", 0.0)
    core = cube + vector
    total = sum(c.get("total_us", 0.0) for c in cats.values()) or 1.0
    # Ascend only: off it there is no AI Core, and "vector" is every operator not named like a matmul (a CPU trace's
    # aten ops, a CUDA trace's kernels) — the rule would advise torch_npu fusions for a CPU or GPU run
    ai_core = (report.get("source") or {}).get("format") in AI_CORE_FORMATS
    if ai_core and core > 0 and core / total >= t["min_compute_share"]:
        cube_share = cube / core
        ev = {
            "cube_us": cube,
            "vector_us": vector,
            "cube_share": cube_share,
            "vector_share": 1 - cube_share,
            "top_vector": cats.get("vector", {}).get("top", []),
            "top_cube": cats.get("cube/matmul", {}).get("top", []),
        }
        if 1 - cube_share > t["bound_ratio"]:
            out.append(
                Finding(
                    "compute.cube_vector_imbalance",
                    "medium",
                    f"vector operators take {1 - cube_share:.0%} of AI Core time: the cube (matmul) units idle",
                    ev,
                    "Vector-bound: fuse the element-wise chains (torch_npu.npu_rms_norm, npu_swiglu, npu_rotary_mul, "
                    "npu_fusion_attention), drop redundant casts/copies, and check the top vector operators listed.",
                )
            )
        elif cube_share > t["bound_ratio"]:
            out.append(
                Finding(
                    "compute.cube_vector_imbalance",
                    "info",
                    f"cube operators take {cube_share:.0%} of AI Core time: the vector units mostly idle",
                    ev,
                    "Cube-bound, as matmul-heavy LLM training usually is: gains come from larger/better-aligned "
                    "matmuls (shapes multiple of 16, inner axis % 256) and fewer small vector ops between them.",
                )
            )
    shares = report["step"]["shares"]
    comm = shares.get("communication", 0.0)
    if report.get("world", 1) > 1 and comm < t["comm_headroom_max"]:
        out.append(
            Finding(
                "scaling.communication_headroom",
                "info",
                f"communication is {comm:.0%} of the step (< {t['comm_headroom_max']:.0%}): adding cards is fine",
                {
                    "communication_share": comm,
                    "comm_not_overlapped_share": shares.get("comm_not_overlapped", 0.0),
                    "world": report.get("world"),
                },
                "Scaling out (more data-parallel replicas) should stay efficient; re-profile after scaling, the share "
                "grows with the number of cards.",
            )
        )
    for row in report.get("communication") or []:
        avg = row["transit_ms"] / max(row["count"], 1)
        if avg > t["retransmission_ms"]:
            out.append(
                Finding(
                    "communication.retransmission",
                    "high",
                    f"{row['op']} transits {avg:.0f} ms on average (> {t['retransmission_ms']:.0f} ms)",
                    {"op": row["op"], "avg_transit_ms": avg, "count": row["count"]},
                    "A transmission this long means RDMA retransmission: check the RoCE links (`python -m tasks env`: "
                    "nic-link, nic-health, nic-pfc), optical modules and switch PFC/ECN.",
                )
            )
    ai_cpu = report.get("ai_cpu_ops") or []
    if ai_cpu:
        out.append(
            Finding(
                "operator.ai_cpu_list",
                "info",
                f"{len(ai_cpu)} operator(s) ran on AI CPU: "
                + ", ".join(o["name"] for o in ai_cpu[:10])
                + (" …" if len(ai_cpu) > 10 else ""),
                {
                    "ops": [
                        {"name": o["name"], "count": o["count"], "total_us": o["total_us"], "max_us": o["max_us"]}
                        for o in ai_cpu
                    ]
                },
                "AI CPU kernels run on the device's control CPU cores: change the dtype or call so an AI Core kernel "
                "is chosen, use a fused torch_npu operator, or write a custom AscendC operator for hot ones.",
            )
        )
    return [f.to_dict() for f in out]


def evaluate(report: dict) -> tuple[list[dict], list[dict]]:
    """(findings, info) of every rule over the report as it stands: run again whenever its step breakdown changes
    (tasks.profiling.engine swaps in msprof-analyze's), else the findings describe a breakdown the report no longer
    shows. Info findings (never a problem) are kept apart from the findings that count."""
    more = guide_rules(report)
    return advise(report) + [f for f in more if f["severity"] != "info"], [f for f in more if f["severity"] == "info"]
