"""Software versions: Python, torch, torch_npu, CANN toolkit, Ascend driver and firmware.

Nothing here imports torch: with torch_npu installed but CANN not loaded even `import torch` dies, so package
versions come from distribution metadata, Ascend versions from the install-info files, and the import itself is
tried in a subprocess (`import_torch_status`).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from tasks.device import package_version

DEFAULT_ASCEND_ROOT = "/usr/local/Ascend"
INSTALL_INFO = "/etc/ascend_install.info"  # written by the driver installer: where the driver went


def read_kv(path: Path) -> dict[str, str]:
    """Parse a `key=value` per line file (install-info / version.info); missing file → {}."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_ranges(value: str) -> list[list[str]]:
    """Ascend's bracketed version lists: '[a],[b]' (a list), '[lo,hi]' (a range) or both mixed, e.g. the driver's
    `compatible_version_fw=[6.4.0,6.4.99],[7.0.0,8.9.9]` or CANN's `compatible_version=[V100R001C13,V100R001C19],
    [V100R001C30]` → [[lo, hi], …] (a single value v becomes [v, v])."""
    out = []
    for group in re.findall(r"\[([^\]]*)\]", value or ""):
        items = [x.strip() for x in group.split(",") if x.strip()]
        if len(items) == 1:
            out.append([items[0], items[0]])
        elif len(items) == 2:
            out.append(items)
    return out


def _toolkit_dirs(root: Path, home: str | None) -> list[tuple[Path, str]]:
    """Where a CANN toolkit may live, in order: $ASCEND_HOME_PATH, the legacy and the new (CANN ≥ 8.5) layouts."""
    dirs = [(Path(home), "ASCEND_HOME_PATH")] if home else []
    dirs.append((root / "ascend-toolkit" / "latest", "ascend-toolkit"))
    dirs.append((root / "cann", "cann"))
    dirs += [(p, "cann") for p in sorted(root.glob("cann-*"), reverse=True)]  # versioned: cann-8.5.0
    return dirs


def install_dirs(root: str | os.PathLike) -> list[Path]:
    """Where an Ascend install root holds something this module reads: the driver, the firmware, a CANN toolkit."""
    return [Path(root) / "driver", Path(root) / "firmware", *(d for d, _ in _toolkit_dirs(Path(root), None))]


def find_cann(root: str | os.PathLike = DEFAULT_ASCEND_ROOT, home: str | None = None) -> dict | None:
    """The CANN toolkit's version from `<toolkit>/<arch>-linux/ascend_toolkit_install.info`, or None."""
    for base, layout in _toolkit_dirs(Path(root), home):
        for info in sorted(base.glob("*-linux/ascend_toolkit_install.info")):
            kv = read_kv(info)
            if kv.get("version"):
                if layout == "ASCEND_HOME_PATH":
                    layout = "ascend-toolkit" if "ascend-toolkit" in info.parts else "cann"
                return {
                    "version": kv["version"],
                    "layout": layout,
                    "info_file": str(info),
                    "arch": kv.get("arch", info.parent.name.split("-")[0]),
                    "innerversion": kv.get("innerversion", ""),
                    "compatible_version": parse_ranges(kv.get("compatible_version", "")),
                }
    return None


def driver_root(root: str | os.PathLike, install_info: str | os.PathLike = INSTALL_INFO) -> Path:
    """The driver may be installed elsewhere than the toolkit; the installer records where."""
    param = read_kv(Path(install_info)).get("Driver_Install_Path_Param")
    return Path(param) if param and Path(param, "driver").is_dir() else Path(root)


def find_driver(root: str | os.PathLike) -> dict | None:
    kv = read_kv(Path(root) / "driver" / "version.info")
    if not kv.get("Version"):
        return None
    return {
        "version": kv["Version"],
        "innerversion": kv.get("Innerversion", ""),
        "compatible_firmware": parse_ranges(kv.get("compatible_version_fw", "")),
    }


def find_firmware(root: str | os.PathLike) -> dict | None:
    kv = read_kv(Path(root) / "firmware" / "version.info")
    return {"version": kv["Version"], "package_version": kv.get("package_version", "")} if kv.get("Version") else None


def collect(
    ascend_root: str | os.PathLike = DEFAULT_ASCEND_ROOT,
    home: str | None = None,
    install_info: str | os.PathLike = INSTALL_INFO,
) -> dict:
    """Every version the stage reports; absent components are None."""
    droot = driver_root(ascend_root, install_info)
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": package_version("torch"),
        "torch_npu": package_version("torch-npu"),
        "amct": package_version("amct_pytorch"),
        "cann": find_cann(ascend_root, home),
        "driver": find_driver(droot),
        "firmware": find_firmware(droot),
    }


# --- "torch_npu installed but CANN missing" -------------------------------------------------------------------

_MISSING_LIB = re.compile(r"(lib[\w.+-]*\.so[\w.]*): cannot open shared object file")


def diagnose_import_failure(stderr: str) -> dict | None:
    """Explain a failed `import torch` from its stderr; None when torch_npu's autoload is not the cause."""
    if "Failed to load the backend extension: torch_npu" not in stderr:
        return None
    missing = _MISSING_LIB.search(stderr)
    if missing:
        return {
            "cause": f"torch_npu is installed but CANN is not loaded ({missing.group(1)} not found), so "
            "`import torch` itself fails",
            "fix": "source the CANN set_env.sh (/usr/local/Ascend/ascend-toolkit/set_env.sh, or "
            "/usr/local/Ascend/cann/set_env.sh) before running, or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
            "to run on CPU",
        }
    # Another root cause (e.g. a torch_npu built for a different torch): name the innermost error.
    errors = [ln.strip() for ln in stderr.splitlines() if re.match(r"^\w*(Error|Exception)\b", ln.strip())]
    root = next((e for e in errors if "backend extension" not in e), "unknown error")
    return {
        "cause": f"torch_npu fails to load ({root}), so `import torch` itself fails",
        "fix": "install the torch/torch_npu pair for this CANN (see the compatibility check), or set "
        "TORCH_DEVICE_BACKEND_AUTOLOAD=0 to run on CPU",
    }


def import_torch_status(timeout: float = 120.0) -> dict:
    """Try `import torch` in a fresh interpreter with this environment: {"ok", "torch", "cause", "fix"}."""
    try:
        proc = subprocess.run(
            # no collector passes in a probe that exits after the import (a quarter of its CPU otherwise)
            [sys.executable, "-c", "import gc; gc.disable(); import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "cause": f"`import torch` did not finish in {timeout:.0f} s", "fix": ""}
    if proc.returncode == 0:
        return {"ok": True, "torch": proc.stdout.strip().splitlines()[-1]}
    found = diagnose_import_failure(proc.stderr)
    if found:
        return {"ok": False, **found}
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"ok": False, "cause": f"`import torch` fails ({last})", "fix": "reinstall requirements.txt"}
