"""The NPU code paths held to the real Ascend behaviour (issue 14's defects), on the CPU machine: each test names the
upstream fact it encodes (ProcessGroupHCCL.cpp, PYTORCH_NPU_ALLOC_CONF.md, msprof-analyze, install-info formats)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.envcheck import compat, system, versions

REPO = Path(__file__).resolve().parent.parent


# --- 1. the env probe all-reduces only dtypes HCCL accepts ------------------------------------------------------

def test_probe_all_reduces_only_hccl_dtypes(tmp_path, monkeypatch):
    """HCCL on A2 rejects float64 all_reduce ("HCCL AllReduce & Reduce: Unsupported data type"): every tensor the
    probe reduces — correctness, bandwidth and the timing — must be one HCCL accepts, on every backend."""
    import torch
    import torch.distributed as dist

    from tasks.envcheck import probe_worker

    seen = []
    real = dist.all_reduce

    def spy(tensor, *a, **kw):
        seen.append(tensor.dtype)
        return real(tensor, *a, **kw)

    monkeypatch.setattr(probe_worker.dist, "all_reduce", spy)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        probe_worker._correctness(torch.device("cpu"), 1, 0)
        probe_worker._bandwidth(torch.device("cpu"), 1, 0.01, 1)
    finally:
        dist.destroy_process_group()
    assert seen and set(seen) <= probe_worker.HCCL_ALLREDUCE_DTYPES, seen
    assert torch.float64 not in probe_worker.HCCL_ALLREDUCE_DTYPES


# --- 2. HCCL timeouts: EVENT=0 is valid, EVENT <= EXEC warns, the PG timeout must exceed EXEC -----------------

def test_hccl_event_timeout_zero_and_pg_timeout_pair():
    base = {"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "1836"}
    assert system.check_hccl({**base, "HCCL_EVENT_TIMEOUT": "0"}, "npu", 1900)["status"] == "ok"   # 0 = never
    c = system.check_hccl({**base, "HCCL_EVENT_TIMEOUT": "1836"}, "npu", 1900)
    assert c["status"] == "warn" and "should exceed HCCL_EXEC_TIMEOUT=1836" in c["detail"]
    c = system.check_hccl(base, "npu", 1800)
    assert c["status"] == "fail" and "train.timeout_s 1800 must exceed HCCL_EXEC_TIMEOUT=1836" in c["detail"]
    assert system.check_hccl(base, "npu", 1900)["status"] == "ok"
    c = system.check_hccl({**base, "HCCL_EXEC_TIMEOUT": "0"}, "npu", 1900)
    assert c["status"] == "warn" and "never times out" in c["detail"]


def test_default_pg_timeout_exceeds_default_exec_timeout():
    from tasks.config import ConfigError, load_config

    c = load_config("demo-cpu", sets=["hardware.device=npu"])
    assert c.train.timeout_s > c.hardware.hccl_exec_timeout == 1836
    with pytest.raises(ConfigError, match="train.timeout_s: 1800 must exceed hardware.hccl_exec_timeout 1836"):
        load_config("demo-cpu", sets=["hardware.device=npu", "train.timeout_s=1800"])


# --- 3. bf16 asked of the device, refused before the run -------------------------------------------------------

class _NoBf16Npu:
    """The one answer torch.npu gives on an Ascend 910 (A1) part (torch_npu/npu/utils.py is_bf16_supported)."""

    @staticmethod
    def is_bf16_supported():
        return False


def test_bf16_is_asked_of_the_npu_and_refused_before_training(monkeypatch):
    from tasks import device

    monkeypatch.setattr(device, "device_module", lambda kind: _NoBf16Npu if kind == "npu" else None)
    assert device.bf16_supported("npu") is False
    assert device.bf16_supported("cpu") is True
    problem = device.precision_problem("npu", "bf16")
    assert problem.startswith("train.precision: bf16 is not supported by this Ascend SoC") and "fp32" in problem
    assert device.precision_problem("npu", "fp32") is None and device.precision_problem("cpu", "bf16") is None


# --- 4. OOM advice valid for the allocator settings in force ---------------------------------------------------

def test_oom_advice_matches_the_allocator_settings_in_force():
    from tasks.device import alloc_conf_in_force, parse_alloc_conf
    from tasks.parallel.diagnosis import oom_advice

    gb = 1 << 30
    frag = {"allocated_bytes": 40 * gb, "reserved_bytes": 60 * gb}
    on = oom_advice(frag, "npu", "expandable_segments:True")
    # max_split_size_mb / garbage_collection_threshold need expandable_segments:False (PYTORCH_NPU_ALLOC_CONF.md)
    assert "already uses expandable segments" in on
    assert "expandable_segments:False,max_split_size_mb:128" in on and "max_split_size_mb:128;" not in on
    off = oom_advice(frag, "npu", "")
    assert "set PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in off
    assert "PYTORCH_CUDA_ALLOC_CONF" in oom_advice(frag, "cuda", "")
    assert oom_advice({"allocated_bytes": 59 * gb, "reserved_bytes": 60 * gb}).startswith("memory is really in use")
    assert parse_alloc_conf("expandable_segments:True,max_split_size_mb:128") == {
        "expandable_segments": "True", "max_split_size_mb": "128"}
    assert alloc_conf_in_force("npu", {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}) == \
        "expandable_segments:True"


# --- 5. torch for torch_npu is the CPU build -------------------------------------------------------------------

def _pins(path: Path) -> tuple[dict, list[str]]:
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return dict(ln.split("==") for ln in lines if "==" in ln), [ln for ln in lines if ln.startswith("--")]


def test_npu_requirements_take_torch_from_the_cpu_index():
    pins, options = _pins(REPO / "requirements-npu.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in options
    assert pins["torch"] == pins["torch-npu"].split(".post")[0]
    amct, options = _pins(REPO / "requirements-npu-amct.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in options
    # AMCT asserts a +cpu torch and supports torch 2.1.0 / 2.7.1 only (hicann/amct requirements.txt)
    assert amct["torch"].endswith("+cpu") and amct["torch"].split("+")[0] in ("2.1.0", "2.7.1")
    matrix = compat.load_matrix()["pairs"]
    row = next(r for r in matrix if r["torch_npu"] == amct["torch-npu"])
    assert row["torch"] == amct["torch"].split("+")[0] and compat._key(row["cann"]) >= compat._key("8.5.0")
    docker = (REPO / "docker" / "Dockerfile.ascend").read_text()
    assert "ARG NPU_REQUIREMENTS=requirements-npu.txt" in docker and "pip install -r ${NPU_REQUIREMENTS}" in docker


# --- 7. msprof-analyze: the cluster subcommand, db-only msprof input, Total Op Info@group ------------------------

def _fake_msprof_analyze(tmp_path: Path) -> Path:
    """A recording stand-in for the msprof-analyze console script (only its argv is under test)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "msprof-analyze"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv.txt'}\n")
    exe.chmod(0o755)
    return bin_dir


def test_msprof_analyze_cluster_subcommand_and_db_only_msprof(tmp_path, monkeypatch):
    from tasks.profiling.msprof import run_msprof_analyze

    monkeypatch.setenv("PATH", f"{_fake_msprof_analyze(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    data, out = tmp_path / "data", tmp_path / "out"
    (data / "PROF_000001_x" / "mindstudio_profiler_output").mkdir(parents=True)
    r = run_msprof_analyze(data, out, fmt="msprof")
    assert r["status"] == "skipped" and "only in db format" in r["reason"] and "--type=db" in r["reason"]
    assert not (tmp_path / "argv.txt").exists()
    (data / "PROF_000001_x" / "msprof_20260101120000.db").write_bytes(b"")
    r = run_msprof_analyze(data, out, fmt="msprof")
    assert r["status"] == "ok"
    assert (tmp_path / "argv.txt").read_text().split() == ["cluster", "-m", "all", "-d", str(data), "-o", str(out)]


def test_total_op_info_at_group_is_not_an_op():
    from tasks.profiling.ascend import _cluster_comm, _comm_ops

    info = {"Communication Time Info": {"Elapse Time(ms)": 2.0, "Transit Time(ms)": 1.0, "Wait Time(ms)": 0.5}}
    data = {"step1": {"collective": {"hcom_allReduce__123_0_1@987": info, "Total Op Info@987": info,
                                     "Total Op Info": info}}}
    assert [op.name for op in _comm_ops(data)] == ["hcom_allReduce__123_0_1@987"]


def test_cluster_communication_total_at_group_skipped(tmp_path):
    from tasks.profiling.ascend import _cluster_comm

    info = {"Communication Time Info": {"Elapse Time(ms)": 2.0, "Transit Time(ms)": 1.0, "Wait Time(ms)": 0.5}}
    path = tmp_path / "cluster_communication.json"
    path.write_text(json.dumps({"(0, 1)": {"step1": {"collective": {
        "hcom_allReduce__1@g": {"0": info, "1": info}, "Total Op Info@(0, 1)": {"0": info, "1": info}}}}}))
    per_rank = _cluster_comm(path)
    assert {r: [op.name for op in ops] for r, ops in per_rank.items()} == {0: ["hcom_allReduce__1@g"],
                                                                            1: ["hcom_allReduce__1@g"]}


# --- 11. evaluate loads an AMCT artifact without torchao ---------------------------------------------------------

def test_amct_artifact_loads_and_registers_without_torchao(tmp_path):
    import torch

    from tasks.quant.artifact import META, WEIGHTS

    torch.save(torch.nn.Linear(4, 4), tmp_path / WEIGHTS)
    (tmp_path / META).write_text(json.dumps({"format": "torch_module", "backend": "amct", "model_dir": "x"}))
    code = ("import sys; sys.modules['torchao'] = None\n"   # any `import torchao` now raises ImportError
            "from tasks.quant.artifact import load_quantized, pip_requirements\n"
            f"m = load_quantized({str(tmp_path)!r})\n"
            "print(type(m).__name__, pip_requirements({'backend': 'amct'})[0].split('==')[0])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["Linear", "torch"]


# --- 12. version files: ranges and lists ------------------------------------------------------------------------

def test_version_ranges_and_lists(tmp_path):
    assert versions.parse_ranges("[6.4.0,6.4.99],[7.0.0,8.9.9]") == [["6.4.0", "6.4.99"], ["7.0.0", "8.9.9"]]
    assert versions.parse_ranges("[V100R001C13,V100R001C19],[V100R001C30]") == [
        ["V100R001C13", "V100R001C19"], ["V100R001C30", "V100R001C30"]]
    drv = tmp_path / "driver"
    drv.mkdir()
    (drv / "version.info").write_text("Version=25.2.0\nInnerversion=V100R001C17SPC001B220\n"
                                      "compatible_version=[V100R001C30],[V100R001C13]\n"
                                      "compatible_version_fw=[6.4.0,6.4.99],[7.0.0,8.9.9]\n")
    driver = versions.find_driver(tmp_path)
    # the firmware check must not disappear for a two-range driver
    c = compat.check_firmware(driver, {"version": "7.8.0.2.212"})
    assert c is not None and c["status"] == "ok"
    assert compat.check_firmware(driver, {"version": "6.5.0.1"})["status"] == "fail"
    cann = {"version": "8.3.RC2", "compatible_version": versions.parse_ranges(
        "compatible_version=[V100R001C13,V100R001C19],[V100R001C30]".split("=", 1)[1])}
    assert compat.check_driver_cann(driver, cann)["status"] == "ok"   # C17 is inside [C13, C19]
    driver["innerversion"] = "V100R001C23SPC001"
    assert compat.check_driver_cann(driver, cann)["status"] == "warn"


def test_entrypoint_sources_versioned_cann_dir(tmp_path):
    for v in ("8.5.0", "9.1.0"):
        (tmp_path / f"cann-{v}").mkdir()
        (tmp_path / f"cann-{v}" / "set_env.sh").write_text(f"export ASCEND_HOME_PATH=/opt/cann-{v}\n")
    proc = subprocess.run(["bash", str(REPO / "docker" / "entrypoint-ascend.sh"), "bash", "-c",
                           "echo $ASCEND_HOME_PATH"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "ASCEND_INSTALL_ROOT": str(tmp_path), "ASCEND_HOME_PATH": "",
                               "ASCEND_TOOLKIT_HOME": ""})
    assert proc.returncode == 0 and proc.stdout.strip() == "/opt/cann-9.1.0", proc.stderr


def test_k8s_job_mounts_dcmi_for_npu_smi():
    import yaml

    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "train-job.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/usr/local/dcmi"]]["hostPath"]["path"] == "/usr/local/dcmi"


# --- 13. the field guides' thresholds side by side ---------------------------------------------------------------

def test_clock_offset_warns_above_10ms_and_fails_above_500ms_multi_node():
    clock = {"source": "chronyc", "offset_ms": 42.0, "synchronised": True}
    c = system.check_clock(clock, nnodes=2, max_offset_ms=500, warn_offset_ms=10)
    assert c["status"] == "warn" and "hardware.warn_clock_offset_ms 10" in c["detail"]
    assert system.check_clock({**clock, "offset_ms": 600.0}, 2, 500, 10)["status"] == "fail"
    assert system.check_clock({**clock, "offset_ms": 5.0}, 2, 500, 10)["status"] == "ok"
    assert system.check_clock(clock, 1, 500, 10)["status"] == "ok"   # one node: no cross-node timeline
    from tasks.config import HardwareConfig
    assert (HardwareConfig().warn_clock_offset_ms, HardwareConfig().max_clock_offset_ms) == (10.0, 500.0)
