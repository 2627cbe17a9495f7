"""report.md: the report for people (report.json holds the same numbers for programs)."""

from __future__ import annotations

from tasks.profiling.report import headline


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.2f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def render_markdown(report: dict, charts: dict[str, str] | None = None) -> str:
    src, step = report["source"], report["step"]
    lines = [
        "# Profile report",
        "",
        f"**{headline(report)}**",
        "",
        f"Source: `{src['path']}` ({src['format']}), {report['world']} rank(s), "
        f"{report['steps_per_rank']} profiled step(s) per rank.",
        "",
    ]
    lines += ["## Findings", ""]
    if not report["findings"]:
        lines += ["No rule fired.", ""]
    for f in report["findings"]:
        ev = ", ".join(f"{k}={_fmt(v)}" for k, v in f["evidence"].items() if not isinstance(v, dict))
        lines += [
            f"- **[{f['severity']}] {f['rule']}** — {f['title']}",
            f"  - evidence: {ev}",
            f"  - advice: {f['advice']}",
        ]
    for f in report.get("info") or []:
        lines += [f"- [info] {f['rule']} — {f['title']}"]
    if report.get("op_support"):
        sup = report["op_support"]
        lines += ["", "## Operator support", "", sup["note"]]
        lines += [
            f"- fell back to CPU: `{f['op']}`" + (f" (called at {', '.join(f['called_at'])})" if f["called_at"] else "")
            for f in sup["fallback"]
        ]
        lines += [f"- AI CPU: `{a['op']}` ×{a['count']}, max {a['max_us']:.0f} µs" for a in sup["ai_cpu"]]
    lines += ["", "## Step time (mean per step, ms)", ""]
    # with msprof-analyze as the engine the report's breakdown (the "all" row, judged by the rules) is its step trace,
    # the per-rank rows stay the built-in readers' (engine.apply): say which row is which
    primary = (report.get("engine") or {}).get("used") == "msprof-analyze"
    if primary:
        lines += [
            "Per-rank rows: the built-in readers; **all**: msprof-analyze's step trace, the breakdown the findings "
            "judge (the two are compared under analysis.disagreement).",
            "",
        ]
    rank_label, all_label = ("{} (built-in)", "**all** (msprof-analyze)") if primary else ("{}", "**all**")
    rows = [
        [
            rank_label.format(r["rank"]),
            _ms(r["mean"]["step_us"]),
            _ms(r["mean"]["computing_us"]),
            _ms(r["mean"]["comm_not_overlapped_us"]),
            _ms(r["mean"]["overlapped_us"]),
            _ms(r["mean"]["free_us"]),
            _ms(r["mean"]["bubble_us"]),
            f"{r['shares']['comm_not_overlapped']:.0%}",
            _ms(r["data_wait_us_per_step"]),
        ]
        for r in report["ranks"]
    ]
    rows.append(
        [
            all_label,
            _ms(step["step_us"]),
            _ms(step["computing_us"]),
            _ms(step["comm_not_overlapped_us"]),
            _ms(step["overlapped_us"]),
            _ms(step["free_us"]),
            _ms(step["bubble_us"]),
            f"{step['shares']['comm_not_overlapped']:.0%}",
            "",
        ]
    )
    lines += _table(
        ["rank", "step", "computing", "comm not overlapped", "overlapped", "free", "bubble", "comm share", "data wait"],
        rows,
    )
    slow = report.get("slow_ranks") or {}
    if slow:
        lines += ["## Rank spread ((max − min) / mean)", ""]
        lines += _table(
            ["dimension", "spread"],
            [[d, f"{v['spread']:.1%}"] for d, v in slow["dims"].items()]
            + [[f"{t} bandwidth", f"{v['spread']:.1%}"] for t, v in slow.get("links", {}).items()],
        )
    lines += ["## Top operators", ""]
    lines += _table(
        ["operator", "core", "category", "count", "total ms", "avg µs", "max µs", "share"],
        [
            [
                o["name"],
                o["core"],
                o["category"],
                o["count"],
                _ms(o["total_us"]),
                f"{o['avg_us']:.1f}",
                f"{o['max_us']:.1f}",
                f"{o['share']:.1%}",
            ]
            for o in report["top_ops"]
        ],
    )
    lines += ["## By category", ""]
    lines += _table(
        ["category", "total ms", "share", "top operators"],
        [[c, _ms(v["total_us"]), f"{v['share']:.1%}", ", ".join(v["top"])] for c, v in report["categories"].items()],
    )
    if report["communication"]:
        lines += ["## Communication ops", ""]
        lines += _table(
            ["op", "kind", "count", "elapse ms", "transit ms", "wait ms", "wait ratio"],
            [
                [
                    c["op"],
                    c["kind"],
                    c["count"],
                    f"{c['elapse_ms']:.2f}",
                    f"{c['transit_ms']:.2f}",
                    f"{c['wait_ms']:.2f}",
                    f"{c['wait_ratio']:.0%}",
                ]
                for c in report["communication"][:15]
            ],
        )
    if report["memory"]:
        m = report["memory"]
        lines += [
            "## Memory",
            "",
            f"Peak allocated {m['peak_allocated_mb']:.1f} MB, peak reserved "
            f"{m['peak_reserved_mb']:.1f} MB (max over ranks).",
            "",
        ]
    if report.get("baseline_note") and not report["baseline"]:
        lines += ["## Baseline", "", report["baseline_note"] + ".", ""]
    if report["baseline"]:
        b = report["baseline"]
        lines += [
            "## Baseline",
            "",
            f"Compared with run `{b['run_id']}` (regression threshold {b['threshold']:.0%}).",
            "",
        ]
        lines += _table(
            ["metric", "baseline", "current", "change"],
            [[k, _fmt(v["baseline"]), _fmt(v["current"]), f"{v['change']:+.1%}"] for k, v in b["metrics"].items()],
        )
    for name, path in (charts or {}).items():
        lines += [f"![{name}]({path})", ""]
    if src["variants"]:
        lines += ["## Input files", ""] + [f"- {v}" for v in src["variants"]] + [""]
    lines += [f"- {n}" for n in src["notes"]]
    tool = src.get("msprof_analyze")
    if tool:
        lines.append(f"- msprof-analyze: {tool['status']}" + (f" — {tool.get('reason') or tool.get('output', '')}"))
    return "\n".join(lines).rstrip() + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)
