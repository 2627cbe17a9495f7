"""Ascend profiler output → RankData: torch_npu `*_ascend_pt/ASCEND_PROFILER_OUTPUT`, msprof `PROF_*`, and
msprof-analyze `cluster_analysis_output`. Formats as documented by their producers — Ascend/pytorch
`docs/en/developer_notes/ascend_pytorch_profiler_user_guide.md`, Ascend/msprof
`docs/en/user_guide/profile_data_file_references.md`, Ascend/msprof-analyze's cluster_analyse README — and as their
test fixtures show; files recognised by header.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from tasks.errors import StageError
from tasks.profiling import tables
from tasks.profiling import timeline as tl
from tasks.profiling.model import CommOp, Op, RankData, Step
from tasks.profiling.torch_trace import data_wait_per_step

OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
_INFO_RE = re.compile(r"^profiler_info_(\d+)\.json$")
_NPU_RE = re.compile(r"NPU\s*(\d+)")
_OVERLAP_THREADS = {
    "Computing": "computing",
    "Communication": "communication",
    "Communication(Not Overlapped)": "comm_not_overlapped",
    "Free": "free",
}


class Files:
    """The CSV tables (by detected kind) and JSON documents (trace / communication) of one folder tree."""

    def __init__(self, paths: list[Path]):
        self.tables: dict[str, list[tuple[Path, list[str], list[dict]]]] = defaultdict(list)
        self.traces: list[tuple[Path, list[dict]]] = []
        self.comm: list[tuple[Path, dict]] = []
        self.variants: list[str] = []
        for p in sorted(paths):
            if p.suffix == ".csv":
                kind = tables.detect_kind(tables.read_header(p))
                if kind:  # files we don't use (api_statistic, operator_details, …) are never read past the header
                    header, rows = tables.read_csv(p)
                    self.tables[kind].append((p, header, rows))
                    self.variants.append(f"{_stem(p.name)}: {tables.variant(kind, header)}")
            elif p.suffix == ".json":
                self._json(p)

    def _json(self, p: Path) -> None:
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StageError(f"{p}: not valid JSON ({e}); the profiler was interrupted while writing it") from None
        if tl.is_trace(data):
            self.traces.append((p, tl.load_trace(p)[1]))
        elif _comm_ops(data):
            self.comm.append((p, data))

    def rows(self, kind: str) -> list[dict]:
        return [r for _, _, rows in self.tables.get(kind, []) for r in rows]


def _stem(name: str) -> str:
    """op_summary_0_1_20231201120001.csv → op_summary_*.csv: one line per file kind in the report."""
    return re.sub(r"(_\d+)+(?=\.csv$)", "_*", name)


def _files_under(root: Path) -> list[Path]:
    # Raw binary collections live in data/ folders; only parsed text output is read.
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in (".csv", ".json") and "data" not in p.relative_to(root).parts[:-1]
    ]


# ---------------------------------------------------------------------------------------------- step breakdown


def steps_from_step_trace(rows: list[dict]) -> dict[int | None, list[Step]]:
    """step_trace_time.csv rows by Device_id (None when the older header has no Device_id column)."""
    out = defaultdict(list)
    for r in rows:
        step = tables.num(r.get("Step"))
        out[_int(r.get("Device_id"))].append(
            Step(
                step=int(step) if step is not None else None,
                computing=_f(r, "Computing"),
                comm_not_overlapped=_f(r, "Communication(Not Overlapped)"),
                overlapped=_f(r, "Overlapped"),
                communication=_f(r, "Communication"),
                free=_f(r, "Free"),
                bubble=_f(r, "Bubble"),
                preparing=_f(r, "Preparing"),
            )
        )
    return dict(out)


def steps_from_trace(events: list[dict]) -> dict[int | None, list[Step]]:
    """The "Overlap Analysis" process of trace_view.json / msprof_*.json, cut at ProfilerStep#N when present."""
    procs, threads = tl.names(events)
    labels = {
        e.get("pid"): str((e.get("args") or {}).get("labels", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_labels"
    }
    xs = tl.spans(events)
    windows = tl.step_windows(xs)
    out = {}
    for pid in [p for p, n in procs.items() if n == "Overlap Analysis"]:
        parts = defaultdict(list)
        for e in xs:
            field = _OVERLAP_THREADS.get(threads.get((pid, e.get("tid")), ""))
            if e.get("pid") == pid and field:
                parts[field].append((e["ts"], e["ts"] + e["dur"]))
        if not parts:
            continue
        merged = {k: tl.union(v) for k, v in parts.items()}
        bubble = tl.union(
            (e["ts"], e["ts"] + e["dur"]) for e in xs if str(e.get("name", "")).startswith("hcom_receive")
        )
        wins = windows or [
            (None, min(s for v in merged.values() for s, _ in v), max(e for v in merged.values() for _, e in v))
        ]
        m = _NPU_RE.search(labels.get(pid, ""))
        out[int(m.group(1)) if m else None] = [_window_step(n, lo, hi, merged, bubble) for n, lo, hi in wins]
    return out


def _window_step(n, lo, hi, merged, bubble) -> Step:
    part = {k: tl.length(tl.clip(v, lo, hi)) for k, v in merged.items()}
    comm, not_ov = part.get("communication", 0.0), part.get("comm_not_overlapped", 0.0)
    return Step(
        step=n,
        computing=part.get("computing", 0.0),
        comm_not_overlapped=not_ov,
        overlapped=comm - not_ov,
        communication=comm,
        free=part.get("free", 0.0),
        bubble=tl.length(tl.clip(bubble, lo, hi)),
    )


# ---------------------------------------------------------------------------------------------- operators


def ops_from_kernels(rows: list[dict]) -> dict[int | None, list[Op]]:
    """kernel_details / op_summary rows aggregated per device by op type (by name when the type is N/A)."""
    acc = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0, ""]))
    for r in tables.kernel_rows(rows):
        dur = tables.num(r.get("Duration(us)"))
        if dur is None:
            continue
        op_type, name = tables.text(r.get("Type")), tables.text(r.get("Name"))
        key = op_type if op_type and op_type != "N/A" else name
        a = acc[_int(r.get("Device_id"))][key]
        a[0] += 1
        a[1] += dur
        a[2] = max(a[2], dur)
        a[3] = a[3] or tables.text(r.get("Accelerator Core"))
    return {dev: [Op(k, core, c, t, m) for k, (c, t, m, core) in ops.items()] for dev, ops in acc.items()}


def ops_from_statistic(rows: list[dict]) -> dict[int | None, list[Op]]:
    out = defaultdict(list)
    for r in rows:
        out[_int(r.get("Device_id"))].append(
            Op(
                tables.text(r.get("OP Type")),
                tables.text(r.get("Core Type")),
                int(_f(r, "Count")),
                _f(r, "Total Time(us)"),
                tables.num(r.get("Max Time(us)")) or _f(r, "Avg Time(us)"),
            )
        )
    return dict(out)


# ---------------------------------------------------------------------------------------------- communication


def _comm_ops(data) -> list[CommOp]:
    """communication.json: {step: {"collective"|"p2p": {op@group: {"Communication Time Info": …}}}}; older files
    without the step level are accepted too. "Total Op Info" — and msprof-analyze's per-group "Total Op Info@{group}"
    (cluster_analyse/analysis/communication_analysis.py) — is the producer's own sum and is skipped."""
    if not isinstance(data, dict):
        return []
    steps = [data] if {"collective", "p2p"} & set(data) else [v for v in data.values() if isinstance(v, dict)]
    out = []
    for step in steps:
        for kind in ("collective", "p2p"):
            for name, info in (step.get(kind) or {}).items():
                if is_total(name) or not isinstance(info, dict) or "Communication Time Info" not in info:
                    continue
                out.append(comm_op(name, kind, info))
    return out


TOTAL_OP_INFO = "Total Op Info"  # msprof-analyze prof_common/constant.py TOTAL_OP_INFO


def is_total(name) -> bool:
    """'Total Op Info' or 'Total Op Info@<group>': a sum over the real ops, never an op itself."""
    return str(name).startswith(TOTAL_OP_INFO)


def comm_op(name: str, kind: str, info: dict) -> CommOp:
    t = info.get("Communication Time Info") or {}
    bw = {}
    for transport, b in (info.get("Communication Bandwidth Info") or {}).items():
        if isinstance(b, dict) and (tables.num(b.get("Transit Size(MB)")) or 0) > 0:
            bw[transport] = (tables.num(b.get("Transit Size(MB)")) or 0.0, tables.num(b.get("Transit Time(ms)")) or 0.0)
    return CommOp(
        name,
        kind,
        tables.num(t.get("Elapse Time(ms)")) or 0.0,
        tables.num(t.get("Transit Time(ms)")) or 0.0,
        tables.num(t.get("Wait Time(ms)")) or 0.0,
        bw,
    )


# ---------------------------------------------------------------------------------------------- memory


def memory_peak(rows: list[dict]) -> dict:
    """memory_record.csv: peak allocated over the framework components, peak reserved over all; MB or KB."""
    alloc = reserved = 0.0
    for r in rows:
        scale = 1.0 if "Total Reserved(MB)" in r else 1 / 1024
        res = (tables.num(r.get("Total Reserved(MB)", r.get("Total Reserved(KB)"))) or 0.0) * scale
        reserved = max(reserved, res)
        if tables.text(r.get("Component")).upper() != "APP":  # APP is the whole process, not the allocator
            alloc = max(alloc, (tables.num(r.get("Total Allocated(MB)", r.get("Total Allocated(KB)"))) or 0.0) * scale)
    return {"allocated": alloc, "reserved": reserved} if rows else {}


# ---------------------------------------------------------------------------------------------- one folder


def read_rank_folder(root: Path, fallback_rank: int) -> tuple[list[RankData], list[str]]:
    """One `*_ascend_pt`, one `ASCEND_PROFILER_OUTPUT` or one `PROF_*` folder → its rank(s) (msprof may hold several
    devices in one PROF_ folder) and the header variants seen."""
    out_dir = root / OUTPUT_DIR if (root / OUTPUT_DIR).is_dir() else root
    if root.name.endswith("_ascend_pt") and out_dir is root:
        raise StageError(
            f"{root}: {OUTPUT_DIR}/ missing — the raw data was never parsed; run "
            f"`python -c \"from torch_npu.profiler.profiler import analyse; analyse('{root}')\"`"
        )
    paths = _files_under(out_dir) if not root.name.startswith("PROF_") else _files_under(root)
    files = Files(paths)
    steps = steps_from_step_trace(files.rows("step_trace"))
    if not steps:
        for _, events in files.traces:
            steps.update(steps_from_trace(events))
    kernels = files.rows("kernel_details") + files.rows("op_summary")  # ops_from_kernels unifies the names
    if not steps and kernels:  # older CANN / partial export: analyse what the kernels hold, say what is missing
        from tasks.profiling.kernels_only import steps_from_kernels

        steps, note = steps_from_kernels(kernels)
        files.variants.append(note)
        files.variants += [f"note: {why}" for why in _step_trace_problems(paths)]  # the step trace was there
    if steps:  # operators come from the kernel tables: one there but unread is said, not passed over
        instead = "operators from op_statistic instead" if files.rows("op_statistic") else "its operators left out"
        files.variants += [f"note: {why}: {instead}" for why in _kernel_problems(paths)]
    if not steps:
        if problems := _step_trace_problems(paths) + _kernel_problems(paths):  # there, but unusable: not "missing"
            raise StageError(f"{root}: {'; '.join(problems)} — no step breakdown; re-run the parser or re-export")
        want = (
            "mindstudio_profiler_output/msprof_*.json"
            if root.name.startswith("PROF_")
            else f"{OUTPUT_DIR}/step_trace_time.csv (or trace_view.json)"
        )
        hint = (
            "only the db export is there: collect with export_type=Text (as tasks.profiling.collect does)"
            if any(out_dir.glob("*.db"))
            else "profile at level 1 or re-run the parser"
        )
        raise StageError(f"{root}: {want} missing — no step breakdown; {hint}")
    ops = ops_from_kernels(kernels) if kernels else ops_from_statistic(files.rows("op_statistic"))
    comm = [op for _, data in files.comm for op in _comm_ops(data)]
    windows = [w for _, ev in files.traces for w in tl.step_windows(tl.spans(ev))]
    waits = [data_wait_per_step(tl.spans(ev), windows) for _, ev in files.traces] if windows else []
    mem = memory_peak(files.rows("memory_record"))
    base = _rank_id(root.parent if root.name == OUTPUT_DIR else root, fallback_rank)
    ranks = []
    for i, (dev, dev_steps) in enumerate(sorted(steps.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))):
        rank = base if len(steps) == 1 else (dev if dev is not None else base + i)
        dev_ops = ops.get(dev) if len(steps) > 1 else [o for v in ops.values() for o in v]
        ranks.append(
            RankData(
                rank=rank,
                origin=str(root),
                steps=dev_steps,
                ops=dev_ops or [],
                comm_ops=comm if len(steps) == 1 else [],
                data_wait_us=next((w for w in waits if w), []),
                memory_peak_mb=mem,
            )
        )
    return ranks, files.variants


def _step_trace_problems(paths: list[Path]) -> list[str]:
    """Why each step_trace_time.csv present gave no step: no data rows (0 bytes or a header only) or a header that is
    not step_trace's (an interrupted or foreign export)."""
    return unusable_tables(paths, "step_trace_time", "step_trace")  # torch_npu's, not msprof's step_trace_*


# The operator tables by their producers' file names (torch_npu: kernel_details.csv; msprof: op_summary_<ts>.csv):
# one that is there under its name but whose header is not recognised would be passed over without a word. Either
# header is read under either name (ops_from_kernels unifies them).
KERNEL_FILES = ("kernel_details", "op_summary")


def _kernel_problems(paths: list[Path]) -> list[str]:
    return [
        why for prefix in KERNEL_FILES for why in unusable_tables(paths, prefix, prefix, rows=False, also=KERNEL_FILES)
    ]


def unusable_tables(paths: list[Path], prefix: str, kind: str, rows: bool = True, also: tuple = ()) -> list[str]:
    """Why each `<prefix>*.csv` present gives nothing: 0 bytes, a header that is not `kind`'s (an interrupted or
    foreign export: the columns it lacks are named), or (rows) a header only. A header of a kind in `also` is read."""
    out = []
    for p in sorted(paths):
        if not (p.name.startswith(prefix) and p.suffix == ".csv"):
            continue
        header = tables.read_header(p)
        if tables.detect_kind(header) not in (kind, *also):
            if not (header and any(header)):
                out.append(f"{p} has no data rows (an empty file)")
                continue
            cols = ", ".join(h for h in header if h) or "none"
            lacks = tables.missing_columns(kind, header)
            partial = 0 < len(lacks) < len(tables.SIGNATURES[kind])  # kind's file with columns lost: name those
            out.append(
                f"{p} header not recognised as {kind} "
                + (f"(no column {', '.join(lacks)})" if partial else f"(columns {cols})")
            )
        elif rows and not tables.read_csv(p)[1]:
            out.append(f"{p} has no data rows (header only)")
    return out


def _rank_id(root: Path, fallback: int) -> int:
    """torch_npu: profiler_info_{rank}.json beside ASCEND_PROFILER_OUTPUT; msprof: device_{id}/."""
    for p in root.glob("profiler_info*.json"):
        m = _INFO_RE.match(p.name)
        if m:
            return int(m.group(1))
    devices = sorted(int(p.name.split("_")[1]) for p in root.glob("device_*") if p.name.split("_")[1].isdigit())
    return devices[0] if len(devices) == 1 else fallback


# msprof-analyze's DB output (26.2.0: cluster_analyse/analysis/step_trace_time_analysis.py writes table
# ClusterStepTraceTime into cluster_analysis_output/cluster_analysis.db when its input was torch_npu's db export;
# columns from cluster_analyse/common_func/tables_config.py ClusterStepTraceTimeMap) → the CSV's header names.
CLUSTER_DB = "cluster_analysis.db"
CLUSTER_DB_COLUMNS = {
    "step": "Step",
    "type": "Type",
    "index": "Index",
    "computing": "Computing",
    "communication_not_overlapped": "Communication(Not Overlapped)",
    "overlapped": "Overlapped",
    "communication": "Communication",
    "free": "Free",
    "stage": "Stage",
    "bubble": "Bubble",
    "communication_not_overlapped_and_exclude_receive": "Communication(Not Overlapped and Exclude Receive)",
    "preparing": "Preparing",
}


def cluster_db_rows(path: Path) -> list[dict]:
    """ClusterStepTraceTime of a cluster_analysis.db as cluster_step_trace_time.csv rows ([] without the table)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            cur = con.execute("SELECT * FROM ClusterStepTraceTime")
            names = [CLUSTER_DB_COLUMNS.get(d[0], d[0]) for d in cur.description]
            return [{k: ("" if v is None else str(v)) for k, v in zip(names, row)} for row in cur.fetchall()]
        finally:
            con.close()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return []
        raise StageError(f"{path}: not a readable SQLite database ({e}); run msprof-analyze again") from None


def read_cluster(root: Path) -> tuple[list[RankData], list[str]]:
    """msprof-analyze's cluster_analysis_output: cluster_step_trace_time.csv (+ cluster_communication.json) from a
    text input, or its cluster_analysis.db (ClusterStepTraceTime) from a db input — what msprof-analyze ≥ 8.x
    writes when the profiling folders hold ascend_pytorch_profiler_{rank}.db, which torch_npu on CANN ≥ 8.5 writes
    with the text export too (msprof-analyze cluster_data_preprocess/prof_data_allocate.py prefers the db)."""
    files = Files([p for p in root.iterdir() if p.is_file() and p.suffix == ".csv"])
    rows = files.rows("cluster_step_trace")
    if not rows and (root / CLUSTER_DB).is_file():
        rows = cluster_db_rows(root / CLUSTER_DB)
        files.variants.append(f"{CLUSTER_DB}: ClusterStepTraceTime")
    rows = [r for r in rows if tables.text(r.get("Type")).lower() == "rank"]
    if not rows and (
        problems := unusable_tables(list(root.glob("*.csv")), "cluster_step_trace_time", "cluster_step_trace")
    ):
        raise StageError(
            f"{root}: {'; '.join(problems)} — run `msprof-analyze cluster -m all -d <profiling dir>` again"
        )
    if not rows:
        raise StageError(
            f"{root}: neither cluster_step_trace_time.csv nor {CLUSTER_DB} (ClusterStepTraceTime) has rank rows — "
            "run `msprof-analyze cluster -m all -d <profiling dir>` again"
        )
    by_rank = defaultdict(list)
    for r in rows:
        by_rank[int(_f(r, "Index"))].extend(steps_from_step_trace([r])[None])
    comm = _cluster_comm(root / "cluster_communication.json")
    ranks = [RankData(rank=k, origin=str(root), steps=v, comm_ops=comm.get(k, [])) for k, v in sorted(by_rank.items())]
    return ranks, files.variants


def _cluster_comm(path: Path) -> dict[int, list[CommOp]]:
    """{group: {step: {op: {rank: info}}}} (the p2p/collective level is optional) → comm ops per rank."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None
    out = defaultdict(list)

    def walk(node, name: str, kind: str):
        for key, val in node.items():
            if not isinstance(val, dict):
                continue
            if "Communication Time Info" in val and str(key).isdigit():
                out[int(key)].append(comm_op(name, kind, val))
            elif not is_total(key):
                walk(val, key if not str(key).isdigit() else name, key if key in ("p2p", "collective") else kind)

    walk(data if isinstance(data, dict) else {}, "", "collective")
    return dict(out)


def _f(row: dict, key: str) -> float:
    return tables.num(row.get(key)) or 0.0


def _int(value) -> int | None:
    v = tables.num(value)
    return int(v) if v is not None else None
