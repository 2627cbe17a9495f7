"""`load_profile(PATH)`: find what a folder holds and read it into one Profile.

PATH may be one rank's `*_ascend_pt` or `ASCEND_PROFILER_OUTPUT`, a folder of ranks, an msprof `PROF_*` folder, an
msprof-analyze `cluster_analysis_output` (or a folder holding one), torch.profiler traces (`*.json`, or `*.json.gz`
from torch's use_gzip export), or one trace file. When a folder holds several kinds, per-rank Ascend data wins over
the cluster summary (it has operators too), which wins over traces.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

from tasks.errors import StageError
from tasks.profiling import ascend, tables
from tasks.profiling import timeline as tl
from tasks.profiling.model import Profile
from tasks.profiling.torch_trace import read_torch_trace

CLUSTER_DIR = "cluster_analysis_output"
EXPECTED = (
    "*_ascend_pt/ or ASCEND_PROFILER_OUTPUT/, PROF_*/mindstudio_profiler_output/, cluster_analysis_output/, "
    "or torch.profiler *.json / *.json.gz traces"
)


def _is_rank_unit(p: Path) -> bool:
    return p.name.endswith("_ascend_pt") or p.name == ascend.OUTPUT_DIR or p.name.startswith("PROF_")


def _is_cluster(p: Path) -> bool:
    if p.name == CLUSTER_DIR:
        return True
    for csv_path in p.glob("*.csv"):  # detected by header: teams rename the folder
        if tables.detect_kind(tables.read_header(csv_path)) == "cluster_step_trace":
            return True
    return False


# torch.profiler's tensorboard_trace_handler (+ ".gz" with use_gzip=True) and tasks.profiling.collect.trace_path
TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")


def _not_a_trace(p: Path) -> str:
    size = p.stat().st_size
    what = "is empty (0 bytes)" if size == 0 else f"is not a torch.profiler trace ({size} bytes, no traceEvents)"
    if size and p.name.endswith(".gz"):
        with open(p, "rb") as f:
            if f.read(2) != b"\x1f\x8b":  # gzip's magic (RFC 1952, 2.3.1)
                what = f"is not gzip ({size} bytes, no gzip header)"
    return (
        f"{p} {what}: the trace was cut short or never written; collect the profile again (or move the file out "
        "of its folder to analyse the other ranks without it)"
    )


def _is_trace_name(name: str) -> bool:
    """A Chrome trace by name: *.json, or *.json.gz (torch's `tensorboard_trace_handler(use_gzip=True)` writes
    `<worker>.<ns>.pt.trace.json.gz`)."""
    return name.endswith((".json", ".json.gz"))


def _looks_like_torch_trace(p: Path) -> bool:
    try:
        with tl.open_trace(p, "rb") as f:
            head = f.read(4096)
    except (EOFError, zlib.error, gzip.BadGzipFile):  # a .gz cut short before 4 KiB, or not gzip: not a trace
        return False
    return b'"traceEvents"' in head or b'"schemaVersion"' in head


def discover(root: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(rank folders, cluster folders, torch trace files) below root; a unit's own subfolders are not searched."""
    units, clusters, traces = [], [], []
    if _is_rank_unit(root):
        return [root], [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here != root and _is_rank_unit(here):
            units.append(here)
            dirnames[:] = []
            continue
        if _is_cluster(here):
            clusters.append(here)
            dirnames[:] = []
            continue
        if ascend.OUTPUT_DIR in dirnames:  # an *_ascend_pt folder whose name was changed
            units.append(here)
            dirnames[:] = []
            continue
        for f in filenames:
            if _is_trace_name(f) and _looks_like_torch_trace(here / f):
                traces.append(here / f)
            elif f.endswith(TRACE_SUFFIXES):  # named as a trace (torch's handler, our collect) but not one: a rank lost
                raise StageError(_not_a_trace(here / f))
        dirnames.sort()
    return sorted(units), clusters, sorted(traces)


def load_profile(path: str | os.PathLike) -> Profile:
    root = Path(path).expanduser()
    if not root.exists():
        raise StageError(f"{root}: no such file or folder")
    if root.is_file():
        if root.name.endswith(TRACE_SUFFIXES) and not _looks_like_torch_trace(root):
            raise StageError(_not_a_trace(root))
        if not _is_trace_name(root.name) or not _looks_like_torch_trace(root):
            raise StageError(f"{root}: not a torch.profiler trace; point at the profiling folder ({EXPECTED})")
        return Profile(str(root), "torch_trace", [read_torch_trace(root)])
    units, clusters, traces = discover(root)
    if units:
        ranks, variants = [], []
        for i, unit in enumerate(units):
            r, v = ascend.read_rank_folder(unit, fallback_rank=i)
            ranks += r
            variants += v
        fmt = "msprof" if all(u.name.startswith("PROF_") for u in units) else "ascend_pt"
        notes = sorted({v for v in variants if v.startswith("note: ")})  # e.g. kernel_details only
        return _checked(
            Profile(
                str(root),
                fmt,
                ranks,
                variants=sorted(set(variants) - set(notes)),
                notes=[n.removeprefix("note: ") for n in notes],
            )
        )
    if clusters:
        ranks, variants = ascend.read_cluster(clusters[0])
        return _checked(Profile(str(root), "cluster_analysis", ranks, variants=variants))
    if traces:
        ranks = [read_torch_trace(p, fallback_rank=i) for i, p in enumerate(traces)]
        return _checked(Profile(str(root), "torch_trace", ranks))
    raise StageError(f"{root}: no profiling data found (expected {EXPECTED})")


def _checked(profile: Profile) -> Profile:
    seen = {}
    for r in profile.ranks:
        if r.rank in seen:
            raise StageError(
                f"{profile.path}: rank {r.rank} appears twice ({seen[r.rank]} and {r.origin}); "
                "analyse one profiling session at a time"
            )
        seen[r.rank] = r.origin
    profile.ranks.sort(key=lambda r: r.rank)
    return profile
