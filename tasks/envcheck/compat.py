"""Version compatibility: torch_npu ↔ torch ↔ CANN ↔ Python (a published table), driver ↔ firmware ↔ CANN.

The table is data (compat_matrix.yaml); a mismatch names the exact pair to install.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import yaml

from tasks.envcheck import check

MATRIX_FILE = Path(__file__).with_name("compat_matrix.yaml")


@lru_cache(maxsize=4)
def load_matrix(path: str | Path = MATRIX_FILE) -> dict:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    pairs = [{k: (v if k == "eol" else str(v)) for k, v in row.items()} for row in data["pairs"]]
    python = {str(k): [str(x) for x in v] for k, v in data["python"].items()}
    return {"pairs": pairs, "python": python}


def base_version(v: str) -> str:
    """'2.13.0+cpu' → '2.13.0'; '2.9.0.post2' → '2.9.0' (torch_npu builds share torch's X.Y.Z)."""
    m = re.match(r"\d+(\.\d+)*", v or "")
    return m.group(0) if m else v


def _key(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _norm_cann(v: str) -> str:
    return v.upper().removeprefix("CANN").strip()


def _family(cann: str) -> str:
    return ".".join(_norm_cann(cann).split(".")[:2])  # 8.3.RC1 → 8.3


def best_pair(matrix: dict, cann: str, torch: str | None = None) -> dict | None:
    """The torch/torch_npu pair to install for this CANN: same torch if published, else the newest supported."""
    rows = [r for r in matrix["pairs"] if _norm_cann(r["cann"]) == _norm_cann(cann)]
    rows = rows or [r for r in matrix["pairs"] if _family(r["cann"]) == _family(cann)]
    if not rows:
        return None
    ranked = sorted(rows, key=lambda r: (not r.get("eol"), _key(r["torch"]), _key(r["torch_npu"])))
    same = [r for r in ranked if torch and r["torch"] == base_version(torch)]
    return (same or ranked)[-1]


def torchnpu_release(torch_npu: str | None, matrix: dict | None = None) -> str | None:
    """The TorchNPU release of an installed torch_npu ('2.1.0.post8' → '6.0.rc3', from the branch name
    v2.1.0-6.0.rc3); None when unknown (newer than the table)."""
    if not torch_npu:
        return None
    row = next((r for r in (matrix or load_matrix())["pairs"] if r["torch_npu"] == torch_npu.split("+")[0]), None)
    return row["branch"].split("-", 1)[1] if row else None


def _install(row: dict) -> str:
    return f"pip install torch=={row['torch']} torch-npu=={row['torch_npu']} (CANN {row['cann']})"


def check_python(matrix: dict, python: str, torch: str | None) -> dict:
    if not torch:
        return check("python-torch", "fail", "torch is not installed: pip install -r requirements.txt")
    tv, pv = base_version(torch), ".".join(python.split(".")[:2])
    supported = matrix["python"].get(tv)
    if supported is None:
        return check("python-torch", "warn", f"torch {tv} is not in the published Python table; Python {pv} unverified")
    if pv not in supported:
        return check(
            "python-torch",
            "fail",
            f"Python {pv} is not supported by torch {tv} (supported: "
            f"{', '.join(supported)}): use one of those Python versions",
        )
    return check("python-torch", "ok", f"Python {pv} is supported by torch {tv}")


def check_npu_stack(matrix: dict, torch: str | None, torch_npu: str | None, cann: str | None) -> dict:
    """torch_npu ↔ torch ↔ CANN against the published pairs; a failure says exactly what to install."""
    name = "torch_npu-torch-cann"
    if not torch_npu and not cann:
        return check(name, "ok", "no Ascend software (torch_npu, CANN) installed: nothing to match")
    if not torch_npu:
        pair = best_pair(matrix, cann, torch)
        hint = _install(pair) if pair else f"CANN {cann} is not in the published table"
        return check(name, "warn", f"CANN {cann} is installed but torch_npu is not; to use the NPUs: {hint}")
    row = next((r for r in matrix["pairs"] if r["torch_npu"] == torch_npu.split("+")[0]), None)
    if row is None:  # newer than the table: torch_npu X.Y.Z still pairs with torch X.Y.Z
        if torch and base_version(torch_npu) != base_version(torch):
            return check(
                name,
                "fail",
                f"torch_npu {torch_npu} is built for torch {base_version(torch_npu)} but "
                f"torch is {torch}: pip install torch=={base_version(torch_npu)}",
            )
        return check(
            name,
            "warn",
            f"torch_npu {torch_npu} is not in the published table; its CANN ({cann or 'none found'}) is unverified",
        )
    if not cann:
        return check(
            name,
            "fail",
            f"torch_npu {torch_npu} needs CANN {row['cann']} but no CANN toolkit was found: "
            f"install CANN {row['cann']} and source its set_env.sh",
        )
    if torch and base_version(torch) != row["torch"]:
        pair = best_pair(matrix, cann, torch)
        alt = f"{_install(pair)}" if pair else f"pip install torch=={row['torch']}"
        return check(
            name, "fail", f"torch_npu {torch_npu} requires torch {row['torch']} but torch {torch} is installed: {alt}"
        )
    if _norm_cann(cann) != _norm_cann(row["cann"]):
        published = any(_norm_cann(r["cann"]) == _norm_cann(cann) for r in matrix["pairs"])
        if _family(cann) == _family(row["cann"]) and not published:  # a CANN the table lacks: likely compatible
            return check(
                name,
                "warn",
                f"torch_npu {torch_npu} was published for CANN {row['cann']}; CANN {cann} is the same release line",
            )
        pair = best_pair(matrix, cann, torch)
        alt = f"{_install(pair)}, or " if pair else ""
        return check(
            name,
            "fail",
            f"torch_npu {torch_npu} (torch {row['torch']}) requires CANN {row['cann']} but "
            f"CANN {cann} is installed: {alt}install CANN {row['cann']}",
        )
    if row.get("eol"):
        return check(
            name,
            "warn",
            f"torch_npu {torch_npu} + torch {row['torch']} + CANN {row['cann']} is a "
            f"published but end-of-life pair (branch {row['branch']})",
        )
    return check(
        name, "ok", f"torch_npu {torch_npu} + torch {row['torch']} + CANN {row['cann']} (branch {row['branch']})"
    )


def _in_ranges(version: str, ranges: list[list[str]]) -> bool:
    """Whether `version` lies in any [lo, hi] (numeric parts compared, the version cut to the bounds' length)."""
    for lo, hi in ranges:
        n = max(len(_key(lo)), len(_key(hi)))
        if _key(lo) <= _key(version)[:n] <= _key(hi):
            return True
    return False


def _show(ranges: list[list[str]]) -> str:
    return ", ".join(f"[{lo}]" if lo == hi else f"[{lo}, {hi}]" for lo, hi in ranges)


def check_firmware(driver: dict | None, firmware: dict | None) -> dict | None:
    """The driver's version.info states the firmware ranges it works with (compatible_version_fw=[lo,hi],…)."""
    if not driver or not firmware or not driver.get("compatible_firmware"):
        return None
    ranges, fw = driver["compatible_firmware"], firmware["version"]
    if not _in_ranges(fw, ranges):
        what = "the range" if len(ranges) == 1 else "the ranges"
        return check(
            "driver-firmware",
            "fail",
            f"firmware {fw} is outside {what} {_show(ranges)} that driver "
            f"{driver['version']} supports: install a firmware in that range",
        )
    return check("driver-firmware", "ok", f"firmware {fw} within driver {driver['version']}'s range {_show(ranges)}")


def check_driver_cann(driver: dict | None, cann: dict | None) -> dict | None:
    """The toolkit's install-info lists the driver releases (V100R001Cxx) it was qualified with, as single releases
    and ranges ([V100R001C13,V100R001C19],[V100R001C30])."""
    if not driver or not cann or not cann.get("compatible_version") or not driver.get("innerversion"):
        return None
    release = re.match(r"V\d+R\d+C\d+", driver["innerversion"])
    if not release:
        return check(
            "driver-cann",
            "warn",
            f"driver {driver['version']}'s Innerversion {driver['innerversion']!r} is not a V…R…C… release: not "
            f"checked against CANN {cann['version']}'s compatible list {_show(cann['compatible_version'])}",
        )
    if not _in_ranges(release.group(0), cann["compatible_version"]):
        return check(
            "driver-cann",
            "warn",
            f"driver {driver['version']} ({release.group(0)}) is not in CANN "
            f"{cann['version']}'s compatible list {_show(cann['compatible_version'])}",
        )
    return check("driver-cann", "ok", f"driver {driver['version']} is in CANN {cann['version']}'s compatible list")


def check_amct(
    amct: str | None, torch: str | None, torch_npu: str | None, cann: str | None, matrix: dict | None = None
) -> dict | None:
    """AMCT (quantize.backend=amct) runs only on its supported pair: CANN >= 8.5.0 and a CPU build of torch 2.1.0 or
    2.7.1 with the matching torch_npu (hicann/amct README and docs/zh/quick_install.md: torch_npu 配套 per Ascend's
    version table). "Matching" is the published table's (compat_matrix.yaml, Ascend/pytorch COMPATIBILITY.en.md):
    the torch_npu built for the installed CANN — AMCT's own requirements.txt pins 2.7.1.post4, the CANN 9.0.0 build;
    on CANN 8.5.0 torch 2.7.1's is 2.7.1.post2. None when AMCT is not installed."""
    from tasks.quant.amct_backend import AMCT_MIN_CANN, AMCT_PAIR, AMCT_TORCH

    if not amct:
        return None
    matrix = matrix or load_matrix()
    problems = []
    if not torch or base_version(torch) not in AMCT_TORCH:
        problems.append(f"torch {torch or 'missing'}")
    elif "+cpu" not in torch and "+" in torch:
        problems.append(f"torch {torch} is not the CPU build")
    if torch_npu and torch and base_version(torch_npu) != base_version(torch):
        problems.append(f"torch_npu {torch_npu}")
    if not cann or _key(_norm_cann(cann))[:3] < _key(AMCT_MIN_CANN):
        problems.append(f"CANN {cann or 'missing'}")
    elif torch_npu and not problems:
        row = next((r for r in matrix["pairs"] if r["torch_npu"] == torch_npu.split("+")[0]), None)
        if row and _norm_cann(row["cann"]) != _norm_cann(cann):
            pair = best_pair(matrix, cann, torch)
            fix = (
                f": pip install torch-npu=={pair['torch_npu']}"
                if pair and pair["torch"] == base_version(torch)
                else f", not the CANN {cann} one"
            )
            problems.append(f"torch_npu {torch_npu}, the CANN {row['cann']} build, on CANN {cann}{fix}")
    if problems:
        return check(
            "amct",
            "warn",
            f"AMCT {amct} installed with {', '.join(problems)}: {AMCT_PAIR} "
            "(requirements-npu-amct.txt); quantize.backend=amct will not work",
        )
    return check("amct", "ok", f"AMCT {amct} on torch {torch} + torch_npu {torch_npu} + CANN {cann}")


def version_checks(v: dict, matrix: dict | None = None) -> list[dict]:
    """All version checks over `versions.collect()` output."""
    matrix = matrix or load_matrix()
    cann = (v.get("cann") or {}).get("version")
    out = [
        check_python(matrix, v["python"], v.get("torch")),
        check_npu_stack(matrix, v.get("torch"), v.get("torch_npu"), cann),
        check_firmware(v.get("driver"), v.get("firmware")),
        check_driver_cann(v.get("driver"), v.get("cann")),
        check_amct(v.get("amct"), v.get("torch"), v.get("torch_npu"), cann, matrix),
    ]
    return [c for c in out if c]
