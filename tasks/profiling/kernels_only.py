"""A profiling folder with kernel_details.csv (or op_summary) but no step_trace_time.csv / trace_view.json — older
CANN, or a partial export — is analysed for what it holds instead of refused.

From each kernel's Start Time(us) and Duration(us): computing = union of the non-communication kernels,
communication = union of the HCCL kernels (hcom_*, Accelerator Core COMMUNICATION/HCCL), overlapped = their
intersection, free = the window minus both. Windows are the `Step Id` groups when the column is there (Level1/2),
else the whole capture. The report says that this breakdown is derived, not Ascend's own step trace.
"""

from __future__ import annotations

from collections import defaultdict

from tasks.profiling import tables
from tasks.profiling import timeline as tl
from tasks.profiling.model import Step, categorize

NOTE = (
    "note: no step_trace_time.csv / trace_view.json: the step breakdown is derived from kernel_details timings "
    "(device busy time; host gaps, data wait and pipeline bubble are not visible) — {windows}"
)


def steps_from_kernels(rows: list[dict]) -> tuple[dict[int | None, list[Step]], str]:
    """({device: [Step per Step Id window]}, note)."""
    groups: dict = defaultdict(lambda: defaultdict(lambda: ([], [])))
    for r in tables.kernel_rows(rows):
        start, dur = tables.num(r.get("Start Time(us)")), tables.num(r.get("Duration(us)"))
        if start is None or dur is None:
            continue
        dev = tables.num(r.get("Device_id"))
        step = tables.num(r.get("Step Id"))
        comm, comp = groups[int(dev) if dev is not None else None][int(step) if step is not None else None]
        is_comm = categorize(tables.text(r.get("Name")), tables.text(r.get("Accelerator Core"))) == "communication"
        (comm if is_comm else comp).append((start, start + dur))
    out: dict[int | None, list[Step]] = {}
    per_step = False
    for dev, by_step in groups.items():
        out[dev] = []
        for step, (comm, comp) in sorted(by_step.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            per_step = per_step or step is not None
            c, m = tl.union(comp), tl.union(comm)
            both = tl.union(comp + comm)
            lo, hi = both[0][0], both[-1][1]
            overlapped = tl.length(c) + tl.length(m) - tl.length(both)
            out[dev].append(
                Step(
                    step=step,
                    computing=tl.length(c),
                    comm_not_overlapped=tl.length(m) - overlapped,
                    overlapped=overlapped,
                    communication=tl.length(m),
                    free=(hi - lo) - tl.length(both),
                )
            )
    windows = "one window per Step Id" if per_step else "one window over the whole capture (no Step Id column)"
    return out, NOTE.format(windows=windows)
