"""CSV reading for Ascend profiler output: tolerant of the producers' quirks, strict about what it understands.

Files are recognised by their header, never by their name: torch_npu writes `ASCEND_PROFILER_OUTPUT/*.csv` with
renamed kernel columns, msprof writes `mindstudio_profiler_output/*_<timestamp>.csv` with the original ones, and
teams rename both. Quirks handled (seen in those tools' own test fixtures and docs): a trailing `\\t` inside
time values, `N/A` placeholders, triple-quoted shapes, an optional `Device_id` / `Step Id` / `Preparing` column,
`Block Dim` (CANN < 9) vs `Block Num`, a UTF-8 BOM.
"""

from __future__ import annotations

import csv
from pathlib import Path

from tasks.errors import StageError

_MISSING = {"", "N/A", "NA", "n/a", "-", "None", "null"}

# kind → columns that must all be present (any of the alternatives in a tuple).
SIGNATURES = {
    "cluster_step_trace": ["Step", "Type", "Index", "Computing", "Communication(Not Overlapped)", "Free"],
    "step_trace": ["Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication", "Free"],
    "kernel_details": ["Name", "Type", "Accelerator Core", "Start Time(us)", "Duration(us)"],
    "op_summary": ["Op Name", "OP Type", "Task Type", "Task Start Time(us)", "Task Duration(us)"],
    "op_statistic": ["OP Type", "Core Type", "Count", "Total Time(us)"],
    "memory_record": [
        "Component",
        "Timestamp(us)",
        ("Total Allocated(MB)", "Total Allocated(KB)"),
        ("Total Reserved(MB)", "Total Reserved(KB)"),
    ],
}
# Checked in this order: the cluster file is a superset of step_trace's columns.
_ORDER = ["cluster_step_trace", "step_trace", "kernel_details", "op_summary", "op_statistic", "memory_record"]

# msprof's op_summary names → torch_npu's kernel_details names (torch_npu renames them when it copies the file).
KERNEL_RENAMES = {
    "Op Name": "Name",
    "OP Type": "Type",
    "Task Type": "Accelerator Core",
    "Task Start Time(us)": "Start Time(us)",
    "Task Duration(us)": "Duration(us)",
    "Task Wait Time(us)": "Wait Time(us)",
    "Block Dim": "Block Num",
    "Mix Block Dim": "Mix Block Num",
}


def num(value) -> float | None:
    """'1736413971558972.912\\t' → float; 'N/A' / '' → None."""
    if value is None:
        return None
    text = str(value).strip().strip('"').strip()
    if text in _MISSING:
        return None
    try:
        return float(text)
    except ValueError:
        return None


# Columns that hold a time span or an amount (≥ 0, finite): a negative, NaN or non-numeric value means a corrupt or
# hand-edited file, and summing it would report NaN or a negative step time as a result.
_SPAN_COLUMNS = {
    "Computing",
    "Communication(Not Overlapped)",
    "Overlapped",
    "Communication",
    "Free",
    "Bubble",
    "Preparing",
    "Stage",
    "Communication(Not Overlapped and Exclude Receive)",
    "Count",
}


def _is_span(column: str) -> bool:
    c = column.strip()
    return c in _SPAN_COLUMNS or (
        c.endswith("(us)") and ("Duration" in c or c.endswith(" Time(us)")) and "Wait" not in c
    )


def check_spans(path: Path, header: list[str], rows: list[dict]) -> None:
    """One line naming the file, row and column of the first duration that is negative, NaN/inf or not a number."""
    cols = [h for h in header if _is_span(h)]
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        for c in cols:
            raw = row.get(c)
            if raw is None or str(raw).strip().strip('"').strip() in _MISSING:
                continue
            v = num(raw)
            if v is None or v != v or v in (float("inf"), float("-inf")) or v < 0:
                raise StageError(
                    f"{path}: line {i}, column {c!r}: {str(raw).strip()!r} is not a duration (must be a finite "
                    "number >= 0); the file is corrupt or was edited: export the profile again"
                )


def text(value) -> str:
    return "" if value is None else str(value).strip().strip('"').strip()


def _has(header: set[str], col) -> bool:
    return any(c in header for c in col) if isinstance(col, tuple) else col in header


def missing_columns(kind: str, header: list[str]) -> list[str]:
    """The columns of `kind`'s signature the header lacks (alternatives joined with "/")."""
    cols = {h.strip() for h in header}
    return ["/".join(c) if isinstance(c, tuple) else c for c in SIGNATURES[kind] if not _has(cols, c)]


def detect_kind(header: list[str]) -> str | None:
    cols = {h.strip() for h in header}
    for kind in _ORDER:
        if all(_has(cols, c) for c in SIGNATURES[kind]):
            return kind
    return None


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    """Header and rows of a CSV file; a file that is not CSV or not UTF-8 fails with its path."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            rows = [dict(zip(header, row)) for row in reader if any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise StageError(f"{path}: unreadable CSV ({type(e).__name__}: {e})") from None
    check_spans(path, header, rows)
    return header, rows


def read_header(path: Path) -> list[str]:
    """Only the header line: enough to recognise a file without reading a large one."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return [h.strip() for h in next(csv.reader([f.readline()]), [])]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise StageError(f"{path}: unreadable CSV ({type(e).__name__}: {e})") from None


def variant(kind: str, header: list[str]) -> str:
    """A short description of the header variant (shown in the report so a wrong CANN pairing is visible)."""
    cols = set(header)
    tags = []
    if kind != "memory_record":  # Device_id came with torch_npu 2.6.0-7.1.0 / CANN 8.2
        tags.append("Device_id" if "Device_id" in cols else "no Device_id")
    if kind == "memory_record":
        tags.append("MB" if "Total Reserved(MB)" in cols else "KB")
    if kind == "step_trace":
        tags.append("Preparing" if "Preparing" in cols else "no Preparing (torch_npu ≤ 2.1.0-5.0.0)")
    if kind in ("kernel_details", "op_summary"):
        tags.append("Step Id" if "Step Id" in cols else "")
        tags.append(
            "Block Num (CANN ≥ 9)"
            if "Block Num" in cols
            else "Block Dim (CANN < 9)"
            if "Block Dim" in cols
            else "no block column"
        )
        if any(c.startswith(("aic_", "aiv_", "aicore_time")) for c in cols):
            tags.append("AI Core metrics")
    return f"{kind}: " + ", ".join(t for t in tags if t)


def kernel_rows(rows: list[dict]) -> list[dict]:
    """op_summary rows under kernel_details names, so one code path reads both."""
    return [{KERNEL_RENAMES.get(k, k): v for k, v in row.items()} for row in rows]
