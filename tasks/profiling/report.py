"""The unified report: one JSON-able dict, whatever the backend or producer the profile came from.

Per rank and overall: mean step time and its split (computing, communication not overlapped, overlapped, free,
bubble) with shares of the step; top operators by total time and by category; slow ranks; data-loader wait;
memory peak; communication ops and link bandwidth.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict
from statistics import mean

from tasks.profiling.model import CATEGORIES, Profile, RankData, is_all_to_all, is_allreduce

PARTS = ("computing", "comm_not_overlapped", "overlapped", "communication", "free", "bubble", "preparing")
SPREAD_DIMS = ("step", "computing", "communication", "free")  # msprof-analyze's slow-rank dimensions + the step
_GROUP_RE = re.compile(r"(__\d+(_\d+)*)?(@.*)?$")  # hcom_allReduce__501_0@hash → hcom_allReduce


def _rank_summary(r: RankData) -> dict:
    n = max(len(r.steps), 1)
    avg = {f"{k}_us": sum(getattr(s, k) for s in r.steps) / n for k in PARTS}
    avg["step_us"] = sum(s.total for s in r.steps) / n
    step = avg["step_us"] or 1.0
    shares = {k: avg[f"{k}_us"] / step for k in PARTS}
    shares["busy"] = 1.0 - shares["free"]
    if r.comm_ops:
        allreduce = sum(c.elapse_ms * 1000 for c in r.comm_ops if is_allreduce(c.name)) / n
        all_to_all = sum(c.elapse_ms * 1000 for c in r.comm_ops if is_all_to_all(c.name)) / n
    else:
        allreduce = sum(o.total_us for o in r.ops if o.category == "communication" and is_allreduce(o.name)) / n
        all_to_all = sum(o.total_us for o in r.ops if o.category == "communication" and is_all_to_all(o.name)) / n
    bandwidth = defaultdict(lambda: [0.0, 0.0])
    for c in r.comm_ops:
        for transport, (size_mb, time_ms) in c.bandwidth.items():
            bandwidth[transport][0] += size_mb
            bandwidth[transport][1] += time_ms
    return {
        "rank": r.rank,
        "origin": r.origin,
        "steps": [asdict(s) | {"total": s.total} for s in r.steps],
        "mean": avg,
        "shares": shares,
        "allreduce_us_per_step": allreduce,
        "allreduce_share": allreduce / step,
        "all_to_all_us_per_step": all_to_all,
        "all_to_all_share": all_to_all / step,  # MoE expert parallelism
        "data_wait_us_per_step": mean(r.data_wait_us) if r.data_wait_us else None,
        "memory_peak_mb": r.memory_peak_mb or None,
        # GB/s = MB/ms, the unit communication.json uses.
        "bandwidth_gbps": {t: s / tm for t, (s, tm) in bandwidth.items() if tm > 0},
    }


def _spread(values: dict[int, float]) -> float:
    avg = mean(values.values()) if values else 0.0
    return (max(values.values()) - min(values.values())) / avg if avg > 0 else 0.0


def slow_ranks(ranks: list[dict]) -> dict:
    """(max − min) / mean across ranks per dimension. The slow rank is the one the others wait for in every
    collective, so its communication time is the shortest (msprof-analyze slow_rank votes the same way); without
    communication, the one computing longest."""
    if len(ranks) < 2:
        return {}
    dims = {}
    for dim in SPREAD_DIMS:
        values = {r["rank"]: r["mean"][f"{dim}_us"] for r in ranks}
        dims[dim] = {"spread": _spread(values), "by_rank_us": values, "mean_us": mean(values.values())}
    comm, comp = dims["communication"]["by_rank_us"], dims["computing"]["by_rank_us"]
    slowest = min(comm, key=comm.get) if dims["communication"]["mean_us"] > 0 else max(comp, key=comp.get)
    links = defaultdict(dict)
    for r in ranks:
        for transport, gbps in r["bandwidth_gbps"].items():
            links[transport][r["rank"]] = gbps
    return {
        "dims": dims,
        "slowest_rank": slowest,
        "links": {t: {"spread": _spread(v), "by_rank_gbps": v} for t, v in links.items() if len(v) > 1},
    }


def _ops(profile: Profile, top_n: int) -> dict:
    merged = defaultdict(lambda: {"count": 0, "total_us": 0.0, "max_us": 0.0})
    for r in profile.ranks:
        for o in r.ops:
            m = merged[(o.name, o.core, o.category)]
            m["count"] += o.count
            m["total_us"] += o.total_us
            m["max_us"] = max(m["max_us"], o.max_us)
    grand = sum(m["total_us"] for m in merged.values()) or 1.0
    rows = sorted(
        (
            {
                "name": n,
                "core": c,
                "category": cat,
                **m,
                "avg_us": m["total_us"] / max(m["count"], 1),
                "share": m["total_us"] / grand,
            }
            for (n, c, cat), m in merged.items()
        ),
        key=lambda row: -row["total_us"],
    )
    by_cat = {
        cat: {
            "total_us": sum(x["total_us"] for x in rows if x["category"] == cat),
            "top": [x["name"] for x in rows if x["category"] == cat][:5],
        }
        for cat in CATEGORIES
    }
    for v in by_cat.values():
        v["share"] = v["total_us"] / grand
    ai_cpu = [x for x in rows if x["category"] == "ai_cpu"]
    return {"top_ops": rows[:top_n], "categories": by_cat, "ai_cpu_ops": ai_cpu}


def _communication(profile: Profile) -> list[dict]:
    acc = defaultdict(lambda: {"count": 0, "elapse_ms": 0.0, "transit_ms": 0.0, "wait_ms": 0.0})
    for r in profile.ranks:
        for c in r.comm_ops:
            a = acc[(_GROUP_RE.sub("", c.name) or c.name, c.kind)]
            a["count"] += 1
            a["elapse_ms"] += c.elapse_ms
            a["transit_ms"] += c.transit_ms
            a["wait_ms"] += c.wait_ms
    return sorted(
        (
            {
                "op": op,
                "kind": kind,
                **a,
                "wait_ratio": a["wait_ms"] / (a["wait_ms"] + a["transit_ms"])
                if a["wait_ms"] + a["transit_ms"] > 0
                else 0.0,
            }
            for (op, kind), a in acc.items()
        ),
        key=lambda row: -row["elapse_ms"],
    )


def build_report(profile: Profile, top_n: int = 15) -> dict:
    ranks = [_rank_summary(r) for r in profile.ranks]
    overall = {k: mean(r["mean"][k] for r in ranks) for k in ranks[0]["mean"]}
    step = overall["step_us"] or 1.0
    shares = {k: overall[f"{k}_us"] / step for k in PARTS}
    shares["busy"] = 1.0 - shares["free"]
    waits = {r["rank"]: r["data_wait_us_per_step"] for r in ranks if r["data_wait_us_per_step"] is not None}
    mems = {r["rank"]: r["memory_peak_mb"] for r in ranks if r["memory_peak_mb"]}
    return {
        "source": {"path": profile.path, "format": profile.fmt, "variants": profile.variants, "notes": profile.notes},
        "ranks": ranks,
        "world": len(ranks),
        "steps_per_rank": max(len(r["steps"]) for r in ranks),
        "step": {
            **overall,
            "shares": shares,
            "allreduce_us_per_step": max(r["allreduce_us_per_step"] for r in ranks),
            "allreduce_share": max(r["allreduce_share"] for r in ranks),
            "all_to_all_us_per_step": max(r["all_to_all_us_per_step"] for r in ranks),
            "all_to_all_share": max(r["all_to_all_share"] for r in ranks),
        },
        "slow_ranks": slow_ranks(ranks),
        **_ops(profile, top_n),
        "communication": _communication(profile),
        "data_wait": {"max_us_per_step": max(waits.values()), "by_rank_us_per_step": waits} if waits else None,
        "memory": {
            "peak_allocated_mb": max(m.get("allocated", 0.0) for m in mems.values()),
            "peak_reserved_mb": max(m.get("reserved", 0.0) for m in mems.values()),
            "by_rank": mems,
        }
        if mems
        else None,
        "findings": [],
        "baseline": None,
    }


def headline(report: dict) -> str:
    s = report["step"]
    n = len(report["findings"])
    return (
        f"step {s['step_us'] / 1000:.1f} ms, computing {s['shares']['computing']:.0%}, comm not overlapped "
        f"{s['shares']['comm_not_overlapped']:.0%}, {report['world']} rank(s), {n} finding{'s' * (n != 1)}"
    )
