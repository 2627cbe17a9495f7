"""Host checks: clock offset (HCCL needs nodes within ~500 ms), HCCL timeouts, visible devices, memory, disk."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from tasks.config import HardwareConfig, watchdog_problem
from tasks.envcheck import check
from tasks.units import GB, MIB


def _bounds(field: str) -> tuple[int, int]:
    """The config model's own range of a hardware field (tasks.config, the one copy)."""
    meta = HardwareConfig.model_fields[field].metadata
    return (next(m.ge for m in meta if hasattr(m, "ge")), next(m.le for m in meta if hasattr(m, "le")))


# CANN 8.x documentation, A2/A3 (910B/910C); the two the config sets come from its fields.
HCCL_RANGES = {
    "HCCL_CONNECT_TIMEOUT": _bounds("hccl_connect_timeout"),
    "HCCL_EXEC_TIMEOUT": _bounds("hccl_exec_timeout"),
    "HCCL_EVENT_TIMEOUT": (0, 2147483647),
}


# --- clock ----------------------------------------------------------------------------------------------------


def parse_chronyc(text: str) -> dict:
    """`chronyc tracking`: 'System time : 0.000001622 seconds slow of NTP time' → offset_ms -0.001622."""
    m = re.search(r"System time\s*:\s*([\d.]+)\s+seconds\s+(fast|slow)", text)
    leap = re.search(r"Leap status\s*:\s*(.+)", text)
    offset = float(m.group(1)) * 1000 * (1 if m.group(2) == "fast" else -1) if m else None
    return {
        "source": "chronyc",
        "offset_ms": offset,
        "synchronised": None if not leap else leap.group(1).strip() != "Not synchronised",
    }


def parse_timedatectl(text: str) -> dict:
    """`timedatectl show` (NTPSynchronized=yes) or `timedatectl status` (System clock synchronized: yes)."""
    m = re.search(r"(?:NTPSynchronized=|System clock synchronized:\s*)(yes|no)", text)
    return {"source": "timedatectl", "offset_ms": None, "synchronised": (m.group(1) == "yes") if m else None}


def _run(argv: list[str]) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 and proc.stdout.strip() else None


def clock_status() -> dict:
    """Offset to NTP from chrony when it runs, else systemd's sync flag; unknown when neither answers."""
    for argv, parse in ((["chronyc", "tracking"], parse_chronyc), (["timedatectl", "show"], parse_timedatectl)):
        out = _run(argv)
        if out:
            found = parse(out)
            if found["offset_ms"] is not None or found["synchronised"] is not None:
                return found
    return {"source": None, "offset_ms": None, "synchronised": None}


def check_clock(clock: dict, nnodes: int, max_offset_ms: float, warn_offset_ms: float = 10.0) -> dict:
    """Two thresholds (README "Ascend: thresholds and their sources"): above `warn_offset_ms` (10 ms) timestamps of
    different nodes no longer line up in cluster profiles (a warning); above `max_offset_ms` (500 ms) HCCL link
    set-up times out across nodes (a failure on multi-node, a warning on one)."""
    bad = "fail" if nnodes > 1 else "warn"
    off = clock.get("offset_ms")
    if off is not None and abs(off) > max_offset_ms:
        return check(
            "clock",
            bad,
            f"clock is {off:+.1f} ms off NTP ({clock['source']}), above "
            f"hardware.max_clock_offset_ms {max_offset_ms:g}: fix NTP (chronyc makestep)",
        )
    if clock.get("synchronised") is False:
        return check(
            "clock", bad, f"clock is not NTP-synchronised ({clock['source']}): enable chrony/NTP on every node"
        )
    if off is not None and abs(off) > warn_offset_ms and nnodes > 1:
        return check(
            "clock",
            "warn",
            f"clock is {off:+.1f} ms off NTP ({clock['source']}), above "
            f"hardware.warn_clock_offset_ms {warn_offset_ms:g} (fails above "
            f"{max_offset_ms:g}): cross-node profiles will not line up; tighten NTP",
        )
    if off is None and clock.get("synchronised") is None:
        return check(
            "clock",
            "warn" if nnodes > 1 else "ok",
            "clock offset unknown (no chronyc or timedatectl answer)"
            + ("; check NTP on every node" if nnodes > 1 else "; single node, not needed"),
        )
    what = f"{off:+.3f} ms" if off is not None else "synchronised"
    return check("clock", "ok", f"clock {what} ({clock['source']})")


# --- HCCL timeouts and visible devices --------------------------------------------------------------------------


# HCCL_EXEC_TIMEOUT under HCCL_OP_EXPANSION_MODE=AIV on Atlas A2/A3: range [0, 1091], default 1091,
# "若设置为0或超出最大值1091，将按照1091处理" (0 or above 1091 is taken as 1091) — CANN 9.0.0 env-var
# reference, HCCL_EXEC_TIMEOUT
# (https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/envref_07_0078.html; the same in
# CANNCommunityEdition/900beta1; 8.1.RC1beta1's page: under AIV the wait is fixed at 1091 s).
AIV_EXEC_TIMEOUT_MAX = 1091


def check_hccl(
    values: dict[str, str], kind: str, pg_timeout_s: int | None = None, expansion_mode: str | None = None
) -> dict:
    """HCCL_*_TIMEOUT must be integers in CANN's ranges (a failure on NPU, a warning elsewhere).

    - HCCL_EVENT_TIMEOUT (torch_npu's wait on HCCL's events): 0 means "never time out"; when set it must exceed
      HCCL_EXEC_TIMEOUT (Ascend/pytorch docs/zh/api/environment_variable/collective_communication/
      HCCL_EVENT_TIMEOUT.md). torch_npu only warns when EVENT <= EXEC, or when EXEC is 0 (never) and EVENT is set, so
      both are warnings here too. Unset, torch_npu waits HCCL_EXEC_TIMEOUT + 30 s (0 when EXEC is 0): the docs'
      default 1868 s is only the initial value, replaced when the process group starts (ProcessGroupHCCL
      constructor, kOpWaitTimeoutOffset = 30, torch_npu/csrc/distributed/ProcessGroupHCCL.cpp on master and the
      v2.7.1-7.3.0, v2.7.1-26.0.0, v2.12.0-26.1.0 branches) — so an unset one always exceeds EXEC: the check
      shows the value in force instead of the documented default.
    - The process-group timeout (train.timeout_s) must exceed HCCL_EXEC_TIMEOUT, or the torch watchdog kills the
      job before HCCL reports which collective and rank failed: a failure on NPU.
    - `expansion_mode` (the exported HCCL_OP_EXPANSION_MODE): under AIV, HCCL takes an EXEC of 0 or above 1091 s as
      1091 s (AIV_EXEC_TIMEOUT_MAX): a warning naming the value HCCL will use.
    """
    problems, warnings = [], []
    parsed = {}
    for var, raw in values.items():
        lo, hi = HCCL_RANGES[var]
        try:
            parsed[var] = int(str(raw).strip())
        except ValueError:
            problems.append(f"{var}={raw!r} is not an integer")
            continue
        if not lo <= parsed[var] <= hi:
            problems.append(f"{var}={parsed[var]} outside [{lo}, {hi}]")
    ev, ex = parsed.get("HCCL_EVENT_TIMEOUT"), parsed.get("HCCL_EXEC_TIMEOUT")
    if ev and ex and ev <= ex:  # 0 = never: nothing to compare
        warnings.append(
            f"HCCL_EVENT_TIMEOUT={ev} should exceed HCCL_EXEC_TIMEOUT={ex} (torch_npu warns; the event "
            f"wait may end first and hide the execution error)"
        )
    elif ev and ex == 0:
        warnings.append(
            f"HCCL_EVENT_TIMEOUT={ev} ends the wait while HCCL_EXEC_TIMEOUT=0 never times out (torch_npu warns): "
            f"unset HCCL_EVENT_TIMEOUT, or set both"
        )
    if (expansion_mode or "").strip().upper() == "AIV" and ex is not None and not 0 < ex <= AIV_EXEC_TIMEOUT_MAX:
        warnings.append(
            f"HCCL_EXEC_TIMEOUT={ex} under HCCL_OP_EXPANSION_MODE=AIV: HCCL allows [0, {AIV_EXEC_TIMEOUT_MAX}] there "
            f"and uses {AIV_EXEC_TIMEOUT_MAX} s for 0 or anything above (CANN HCCL_EXEC_TIMEOUT docs): a collective "
            f"or checkpoint wait longer than that times out; unset HCCL_OP_EXPANSION_MODE or plan for "
            f"{AIV_EXEC_TIMEOUT_MAX} s"
        )
    if pg_timeout_s is not None and ex is not None:
        if ex == 0:
            warnings.append(
                f"HCCL_EXEC_TIMEOUT=0 never times out, so train.timeout_s {pg_timeout_s} s (torch's "
                f"watchdog) is the only limit and HCCL never names the failing collective"
            )
        else:
            problems.extend(filter(None, [watchdog_problem(pg_timeout_s, ex)]))
    if problems:
        return check("hccl-timeouts", "fail" if kind == "npu" else "warn", "; ".join(problems + warnings))
    if warnings and kind == "npu":
        return check("hccl-timeouts", "warn", "; ".join(warnings))
    shown = ", ".join(f"{k}={v}" for k, v in parsed.items())
    if "HCCL_EVENT_TIMEOUT" not in values and ex is not None:
        wait = f"{ex + 30} s: HCCL_EXEC_TIMEOUT + 30" if ex else "forever: HCCL_EXEC_TIMEOUT is 0"
        shown += f", HCCL_EVENT_TIMEOUT unset (torch_npu waits {wait})"
    if pg_timeout_s is not None:
        shown += f", train.timeout_s={pg_timeout_s}"
    return check("hccl-timeouts", "ok", shown + ("" if kind == "npu" else f" (unused on {kind})"))


def parse_visible(value: str) -> tuple[list[int], str | None]:
    """Device ids as CANN reads ASCEND_RT_VISIBLE_DEVICES: ascending, and parsing stops at the first bad entry."""
    ids = []
    for item in value.split(","):
        if not re.fullmatch(r"\d+", item):
            return ids, f"entry {item!r} is not a device id, so only {ids} are used"
        if ids and int(item) <= ids[-1]:
            return ids, f"ids must be ascending and unique ({item} after {ids[-1]}), so only {ids} are used"
        ids.append(int(item))
    return ids, None


def check_visible(
    kind: str, var: str, value: str | None, device_count: int, nproc_per_node: int, physical_count: int | None = None
) -> dict:
    """The visible-devices variable, the devices torch sees and nproc_per_node must agree."""
    if kind == "cpu":
        ranks = nproc_per_node or 2
        return check("visible-devices", "ok", f"cpu: {ranks} gloo ranks per node on {device_count} cores")
    label = kind.upper() + "s"
    if value is not None and value.strip():
        ids, problem = parse_visible(value.strip())
        if problem:
            return check(
                "visible-devices",
                "fail",
                f"{var}={value!r}: {problem}; write ascending ids without spaces, e.g. 0,1,2,3",
            )
        if physical_count is not None and ids and ids[-1] >= physical_count:
            return check(
                "visible-devices",
                "fail",
                f"{var}={value} names device {ids[-1]} but the host has {physical_count} {label} (npu-smi)",
            )
        if len(ids) != device_count:
            return check(
                "visible-devices", "warn", f"{var}={value} lists {len(ids)} devices but torch sees {device_count}"
            )
    ranks = nproc_per_node or device_count
    if ranks > device_count:
        return check(
            "visible-devices",
            "fail",
            f"hardware.nproc_per_node {ranks} exceeds the {device_count} visible "
            f"{label}{f' ({var}={value})' if value else ''}",
        )
    return check(
        "visible-devices",
        "ok",
        f"{ranks} ranks on {device_count} visible {label}" + (f" ({var}={value})" if value else ""),
    )


# --- device memory vs the plan's sizing -------------------------------------------------------------------------


def measured_device_memory(kind: str, facts: dict) -> dict | None:
    """The smallest per-device memory this host reports for an accelerator of `kind` (the cluster preset's kind), in
    GB: npu-smi's HBM total per chip on Ascend (MiB, tasks/npu_smi.py; any backend: npu-smi answers without
    torch_npu), torch's `get_device_properties(i).total_memory` on CUDA (the env stage's `devices` facts). None when
    the host does not report one."""
    if kind == "npu":
        chips = [c for c in (facts.get("npu_smi") or {}).get("chips", []) if c.get("memory_total_mb")]
        hbm = [c for c in chips if c.get("memory_kind") == "HBM"] or chips
        if hbm:
            low = min(hbm, key=lambda c: c["memory_total_mb"])
            return {
                "gb": round(low["memory_total_mb"] * MIB / GB, 2),
                "source": f"npu-smi: {low['name']} {low['memory_kind']} total {low['memory_total_mb']} MiB",
            }
    if kind == "cuda" and (facts.get("backend") or {}).get("kind") == "cuda" and facts.get("devices"):
        low = min(facts["devices"], key=lambda d: d["memory_gb"])
        return {"gb": low["memory_gb"], "source": f"torch: {low['name']} total_memory"}
    return None


def check_device_memory(measured: dict | None, sizing_gb: float, sizing_source: str) -> dict | None:
    """The plan, the smoke budget and the rehearsal size every device with `sizing_gb` (hardware.device_memory_gb,
    else the cluster preset's): a device with less memory than that is a plan that cannot fit, so a failure naming
    both figures and the fix. None when nothing was measured."""
    if measured is None:
        return None
    if measured["gb"] < sizing_gb:
        return check(
            "device-memory",
            "fail",
            f"each device has {measured['gb']:g} GB ({measured['source']}) but the plan sizes devices with "
            f"{sizing_gb:g} GB ({sizing_source}): set hardware.device_memory_gb to the real size "
            f"({measured['gb']:g}) or pick the hardware.cluster that matches these devices",
        )
    return check(
        "device-memory",
        "ok",
        f"{measured['gb']:g} GB per device ({measured['source']}), at least the {sizing_gb:g} GB the plan sizes "
        f"with ({sizing_source})",
    )


# --- host memory and disk ---------------------------------------------------------------------------------------


def host_facts() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    model = ""
    try:
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            "",
        )
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "machine": platform.machine(),
        "cpu_model": model or platform.processor(),
        "cores_logical": psutil.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else psutil.cpu_count(),
        "memory_total_gb": round(vm.total / GB, 2),
        "memory_available_gb": round(vm.available / GB, 2),
    }


def check_host_memory(available_gb: float, total_gb: float, min_gb: float) -> dict:
    if available_gb < min_gb:
        return check(
            "host-memory",
            "fail",
            f"only {available_gb:.1f} GB of {total_gb:.1f} GB host memory available, "
            f"below hardware.min_host_memory_gb {min_gb:g}",
        )
    return check("host-memory", "ok", f"{available_gb:.1f} GB of {total_gb:.1f} GB available")


def free_gb(path: str | os.PathLike) -> float:
    """Free space where `path` will be created (its nearest existing ancestor)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free / GB


def check_disk(paths: dict[str, str | os.PathLike], min_gb: float) -> tuple[dict, dict]:
    """Free space for each labelled path (shards, checkpoints); fails below hardware.min_free_disk_gb."""
    free = {label: round(free_gb(p), 2) for label, p in paths.items()}
    low = [f"{label} ({paths[label]}): {gb:.1f} GB free" for label, gb in free.items() if gb < min_gb]
    if low:
        return check("disk", "fail", "; ".join(low) + f", below hardware.min_free_disk_gb {min_gb:g}"), free
    return check("disk", "ok", ", ".join(f"{label} {gb:.0f} GB free" for label, gb in free.items())), free
