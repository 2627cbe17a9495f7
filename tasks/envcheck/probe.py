"""Collective probe: torchrun one rank per local device (2 on CPU) running probe_worker, then judge the result.

On an accelerator the bus bandwidth is compared with the link figure the plan uses and flagged below half: a slow ring
usually means a bad topology, a wrong ASCEND_RT_VISIBLE_DEVICES split or a degraded link. The figure is
hardware.expected_bus_gbps when set, else the configured cluster's (tasks/planner/cluster.py: hardware.intra_node_gbps
or the preset's intra-node figure, 56 GB/s on 910b, 196 GB/s per die on 910c; across nodes the ring's slowest hop is
the inter-node link, so hardware.inter_node_gbps or the preset's); none on CPU or when the cluster preset is not of
the backend's kind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tasks.config import REPO_ROOT
from tasks.envcheck import check
from tasks.fsutil import read_json


def expected_bus(kind: str, hardware) -> tuple[float, str]:
    """(GB/s, where it comes from) the probe's bus bandwidth is judged against; (0.0, "") for no expectation."""
    from tasks.planner.cluster import PRESETS

    if hardware.expected_bus_gbps:
        return hardware.expected_bus_gbps, "hardware.expected_bus_gbps"
    preset = PRESETS.get(hardware.cluster)
    if kind == "cpu" or preset is None or preset.kind != kind:
        return 0.0, ""
    if hardware.nnodes > 1:  # the probe's all_reduce spans the nodes: its ring runs at the inter-node links' rate
        if hardware.inter_node_gbps:
            return hardware.inter_node_gbps, "hardware.inter_node_gbps"
        return preset.inter_gbps, f"hardware.cluster {preset.name}'s inter-node figure"
    if hardware.intra_node_gbps:
        return hardware.intra_node_gbps, "hardware.intra_node_gbps"
    return preset.intra_gbps, f"hardware.cluster {preset.name}'s intra-node figure"


def command(
    kind: str, nproc: int, sizes_mb: list[float], out: Path, timeout_s: int = 120, launcher: list[str] | None = None
) -> list[str]:
    """The torchrun argv (this interpreter's, so the venv's torch is the one probed). `launcher`: what starts torchrun
    (the env stage passes tasks.launch.torchrun.launcher(kind): the ranks start as training's do); default
    torch.distributed.run."""
    return [
        sys.executable,
        *(launcher or ["-m", "torch.distributed.run"]),
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        *worker_args("tasks.envcheck.probe_worker", kind, sizes_mb, timeout_s, out),
    ]


def worker_args(module: str, kind: str, sizes_mb: list[float], timeout_s: int, out: Path) -> list[str]:
    """torchrun's `--log-dir` (elastic_log_dir), then `-m <worker module>` and the flags both probe workers (this
    node's and the cross-node one) take."""
    sizes = [f"{s:g}" for s in sizes_mb]
    return [
        f"--log-dir={elastic_log_dir(out)}",
        *["-m", module, "--kind", kind, "--sizes-mb", *sizes, "--timeout-s", str(timeout_s), "--out", str(out)],
    ]


def elastic_log_dir(out: Path) -> Path:
    """Where torch elastic keeps a probe launch's per-rank files: beside the probe's result, replaced by each launch
    (fresh_elastic_log_dir). Without --log-dir, elastic makes a torchelastic_* directory in the system's temporary
    directory for every launch and never removes it (torch/distributed/elastic/multiprocessing/api.py,
    _make_log_dir: tempfile.mkdtemp(prefix="torchelastic_")): one more a day for every scheduled env stage."""
    out = Path(out)
    return out.with_name(f"{out.stem}-torchelastic")


def fresh_elastic_log_dir(out: Path) -> Path:
    """elastic_log_dir(out), emptied of an earlier launch's files."""
    path = elastic_log_dir(out)
    shutil.rmtree(path, ignore_errors=True)
    return path


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def run(
    kind: str,
    nproc: int,
    sizes_mb: list[float],
    out: Path,
    env_extra: dict | None = None,
    timeout_s: int = 300,
    launcher: list[str] | None = None,
) -> dict:
    """Launch the probe and return its result, or {"error": one line} when it fails or hangs."""
    out = Path(out)
    out.unlink(missing_ok=True)
    fresh_elastic_log_dir(out)
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # Own session: on a hang the whole torchrun tree (agent and ranks) is killed, not just the agent.
    proc = subprocess.Popen(
        command(kind, nproc, sizes_mb, out, timeout_s=min(timeout_s, 600), launcher=launcher),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {
            "error": f"collective probe did not finish in {timeout_s} s (hung collective: check HCCL/NCCL "
            f"connectivity and the visible devices)"
        }
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"collective probe failed (torchrun exit {proc.returncode}): {_last_error(stderr + stdout)}"}
    return read_json(out)


def judge(result: dict, kind: str, expected_bus_gbps: float = 0.0, expected_source: str = "") -> list[dict]:
    """all_reduce correctness (fail) and bus bandwidth against the expected figure (`expected_bus`; warn below half,
    nothing to compare when 0)."""
    if "error" in result:
        return [check("allreduce", "fail", result["error"])]
    n = result["world_size"]
    if not result["allreduce_ok"]:
        return [
            check(
                "allreduce",
                "fail",
                f"all_reduce over {n} {result['backend']} ranks returned wrong sums "
                f"(max error {result['allreduce_max_error']:g})",
            )
        ]
    out = [check("allreduce", "ok", f"all_reduce correct on {n} {result['backend']} ranks")]
    if n < 2 or not result["sizes"]:
        return out  # one rank: no link to measure
    best = max(result["sizes"], key=lambda s: s["busbw_gbps"])
    figure = f"bus bandwidth {best['busbw_gbps']:.2f} GB/s at {best['size_mb']:g} MB"
    expected = expected_bus_gbps
    source = f" ({expected_source})" if expected_source else ""
    if expected and best["busbw_gbps"] < expected / 2:
        out.append(
            check(
                "bus-bandwidth",
                "warn",
                f"{figure} is below half the expected {expected:g} GB/s{source}: check "
                "the device topology (npu-smi info -t topo), the visible devices "
                "and link health; larger hardware.probe_sizes_mb measure closer "
                "to peak",
            )
        )
    else:
        out.append(
            check("bus-bandwidth", "ok", figure + (f" (expected ~{expected:g} GB/s{source})" if expected else ""))
        )
    return out
