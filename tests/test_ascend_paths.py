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


def test_probe_correctness_is_exact_at_any_world_size():
    """fp32 sums are exact below 2^24 only: (rank+1)·arange(4096) passed it from 91 ranks (world 96: error 16 on a
    healthy cluster). The probe's contributions keep every partial sum a small integer: exact in any order."""
    import torch

    from tasks.envcheck.probe_worker import contribution, expected

    for world in (1, 2, 15, 16, 17, 96, 1000):
        parts = [contribution(r) for r in range(world)]
        exact = torch.stack([p.to(torch.int64) for p in parts]).sum(0)
        assert torch.equal(expected(world).to(torch.int64), exact), world
        ring = torch.zeros(4096)  # the ring order, its reverse, and a pairwise tree: all exact
        for p in parts:
            ring += p
        back = torch.zeros(4096)
        for p in reversed(parts):
            back += p
        tree = list(parts)
        while len(tree) > 1:
            tree = [tree[i] + tree[i + 1] if i + 1 < len(tree) else tree[i] for i in range(0, len(tree), 2)]
        for got in (ring, back, tree[0]):
            assert torch.equal(got, expected(world)), world
    assert not torch.equal(expected(96), expected(95))  # a missing rank shows


def test_probe_all_reduces_only_hccl_dtypes(tmp_path, monkeypatch):
    """HCCL on A2 rejects float64 all_reduce ("HCCL allreduce: Unsupported data type"): every tensor the probe
    reduces — correctness, bandwidth and the timing — must be one HCCL accepts, on every backend. Strict hccl mode
    (tasks/collectives.py) refuses any other at the call."""
    import torch
    import torch.distributed as dist

    from tasks import collectives
    from tasks.envcheck import probe_worker

    monkeypatch.setenv(collectives.STRICT_ENV, "hccl")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert probe_worker._correctness(torch.device("cpu"), 1, 0)["allreduce_ok"]
        probe_worker._bandwidth(torch.device("cpu"), 1, 0.01, 1)
    finally:
        dist.destroy_process_group()


# --- 2. HCCL timeouts: EVENT=0 is valid, EVENT <= EXEC warns, the PG timeout must exceed EXEC -----------------


def test_hccl_event_timeout_zero_and_pg_timeout_pair():
    base = {"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "1836"}
    assert system.check_hccl({**base, "HCCL_EVENT_TIMEOUT": "0"}, "npu", 1900)["status"] == "ok"  # 0 = never
    c = system.check_hccl({**base, "HCCL_EVENT_TIMEOUT": "1836"}, "npu", 1900)
    assert c["status"] == "warn" and "should exceed HCCL_EXEC_TIMEOUT=1836" in c["detail"]
    c = system.check_hccl(base, "npu", 1800)
    assert c["status"] == "fail" and "train.timeout_s: 1800 must exceed HCCL_EXEC_TIMEOUT=1836" in c["detail"]
    assert system.check_hccl(base, "npu", 1900)["status"] == "ok"
    c = system.check_hccl({**base, "HCCL_EXEC_TIMEOUT": "0"}, "npu", 1900)
    assert c["status"] == "warn" and "never times out" in c["detail"]


def test_hccl_event_timeout_unset_is_exec_plus_30_and_exec_never_with_event_set_warns(monkeypatch):
    """torch_npu's ProcessGroupHCCL (Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp): an unset
    HCCL_EVENT_TIMEOUT waits HCCL_EXEC_TIMEOUT + 30 s, so llama3-70b-910c's EXEC 5600 is consistent without one (the
    check shows the wait in force, it used to say nothing about it); the docs' 1868 s exported beside EXEC 5600 warns,
    and so does EVENT set while EXEC is 0 (never), as torch_npu does."""
    from tasks import device
    from tasks.config import load_config

    for var in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_EVENT_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config("llama3-70b-910c")
    hccl = device.hccl_env(cfg.hardware)
    c = system.check_hccl(hccl, "npu", cfg.train.timeout_s)
    assert (
        c["status"] == "ok"
        and "HCCL_EVENT_TIMEOUT unset (torch_npu waits 5630 s: HCCL_EXEC_TIMEOUT + 30)" in c["detail"]
    )
    c = system.check_hccl({**hccl, "HCCL_EVENT_TIMEOUT": "1868"}, "npu", cfg.train.timeout_s)
    assert c["status"] == "warn" and "HCCL_EVENT_TIMEOUT=1868 should exceed HCCL_EXEC_TIMEOUT=5600" in c["detail"]
    c = system.check_hccl({**hccl, "HCCL_EXEC_TIMEOUT": "0", "HCCL_EVENT_TIMEOUT": "1868"}, "npu", 6000)
    assert c["status"] == "warn" and "HCCL_EVENT_TIMEOUT=1868 ends the wait while HCCL_EXEC_TIMEOUT=0" in c["detail"]


def test_aiv_expansion_mode_caps_hccl_exec_timeout_at_1091():
    """CANN's HCCL_EXEC_TIMEOUT page (canncommercial/900 envref_07_0078): under HCCL_OP_EXPANSION_MODE=AIV on A2/A3 the
    range is [0, 1091] and 0 or anything above is taken as 1091 s. llama3-70b-910c's 5600 s with AIV exported was
    accepted without a word; now a warning names the 1091 s HCCL will use."""
    base = {"HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "5600"}
    c = system.check_hccl(base, "npu", 6000, "AIV")
    assert c["status"] == "warn"
    assert (
        "HCCL_EXEC_TIMEOUT=5600 under HCCL_OP_EXPANSION_MODE=AIV: HCCL allows [0, 1091] there and uses 1091 s"
        in (c["detail"])
    )
    assert system.check_hccl(base, "npu", 6000, "AI_CPU")["status"] == "ok"
    assert system.check_hccl({**base, "HCCL_EXEC_TIMEOUT": "1000"}, "npu", 1900, "AIV")["status"] == "ok"
    assert "uses 1091 s" in system.check_hccl({**base, "HCCL_EXEC_TIMEOUT": "0"}, "npu", 1900, "AIV")["detail"]


def test_docs_say_every_cluster_preset_is_planned_with_fused_attention():
    """docs/ascend.md said older SoCs "drop the planner's flash-attention assumption"; the planner and the smoke budget
    pass only hardware.cluster to fused_attention_available and every preset answers True, so nothing drops it."""
    from tasks.device import fused_attention_available
    from tasks.planner.cluster import PRESETS

    assert all(fused_attention_available(name) for name in PRESETS)
    text = " ".join((REPO / "docs" / "ascend.md").read_text().split())
    assert "drop the planner's flash-attention assumption" not in text
    assert "plan and smoke budget assume a fused kernel for every cluster preset" in text


def test_default_pg_timeout_exceeds_default_exec_timeout():
    from tasks.config import ConfigError, load_config

    c = load_config("demo-cpu", sets=["hardware.device=npu"])
    assert c.train.timeout_s > c.hardware.hccl_exec_timeout == 1836
    line = r"train.timeout_s: 1800 must exceed HCCL_EXEC_TIMEOUT=1836 \(hardware.hccl_exec_timeout\)"
    with pytest.raises(ConfigError, match=line):
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


def test_the_hccl_timeout_in_force_is_checked_against_the_watchdog_before_launch(monkeypatch):
    """docs/ascend.md: train.timeout_s must exceed HCCL_EXEC_TIMEOUT. The config's rule compared the config's value
    on device npu only; an exported HCCL_EXEC_TIMEOUT=3600 (the page's own advice for slow links) under the default
    1900 s launched, and torch's watchdog would kill the ranks before HCCL named the collective."""
    from tasks.config import load_config
    from tasks.device import hccl_timeout_problem

    hw = load_config("qwen2-7b-910b").hardware
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    assert hccl_timeout_problem("npu", 1900, hw) is None  # the defaults: 1900 > 1836
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "3600")
    assert hccl_timeout_problem("npu", 1900, hw) == (
        "train.timeout_s: 1900 must exceed HCCL_EXEC_TIMEOUT=3600 (exported) so HCCL reports the real error before "
        "torch's watchdog fires: set train.timeout_s to 3664 or more"
    )
    assert hccl_timeout_problem("npu", 3700, hw) is None and hccl_timeout_problem("cpu", 1900, hw) is None
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "0")  # never: the env stage warns, nothing to compare
    assert hccl_timeout_problem("npu", 1900, hw) is None


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
        "expandable_segments": "True",
        "max_split_size_mb": "128",
    }
    assert (
        alloc_conf_in_force("npu", {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}) == "expandable_segments:True"
    )
    # The combination is an error at start-up in torch_npu (NPUAllocatorConfig.cpp), not "ignored".
    assert "ignored" not in on and "refuses max_split_size_mb and garbage_collection_threshold" in on


def test_pytorch_alloc_conf_is_honoured_and_never_set_beside_the_npu_one(monkeypatch, cfg):
    """torch_npu (NPUAllocatorConfig.cpp, branches v2.10.0–v2.12.0, master) reads PYTORCH_NPU_ALLOC_CONF, else
    PYTORCH_ALLOC_CONF, and refuses to start with both set."""
    from tasks import device
    from tasks.errors import StageError
    from tasks.parallel.diagnosis import oom_advice

    npu = device.Backend("npu", "hccl", 8)
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert device.launch_env(npu, cfg.hardware)["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:256")
    env = device.launch_env(npu, cfg.hardware)
    assert "PYTORCH_NPU_ALLOC_CONF" not in env  # the user's PYTORCH_ALLOC_CONF is the one in force
    assert device.alloc_conf_in_force("npu", {**env, "PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == (
        "expandable_segments:False"
    )
    gb = 1 << 30
    advice = oom_advice({"allocated_bytes": 40 * gb, "reserved_bytes": 60 * gb}, "npu", "expandable_segments:False")
    assert "(now PYTORCH_ALLOC_CONF=expandable_segments:False)" in advice
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(StageError, match="PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF are both set") as e:
        device.launch_env(npu, cfg.hardware)
    assert "\n" not in str(e.value)
    assert device.alloc_conf_var("cuda", {"PYTORCH_ALLOC_CONF": "x"}) == "PYTORCH_ALLOC_CONF"
    assert device.alloc_conf_var("cpu", {}) is None


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
    exe.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "argv.txt"}\n')
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
    from tasks.profiling.ascend import _comm_ops

    info = {"Communication Time Info": {"Elapse Time(ms)": 2.0, "Transit Time(ms)": 1.0, "Wait Time(ms)": 0.5}}
    data = {
        "step1": {"collective": {"hcom_allReduce__123_0_1@987": info, "Total Op Info@987": info, "Total Op Info": info}}
    }
    assert [op.name for op in _comm_ops(data)] == ["hcom_allReduce__123_0_1@987"]


def test_cluster_communication_total_at_group_skipped(tmp_path):
    from tasks.profiling.ascend import _cluster_comm

    info = {"Communication Time Info": {"Elapse Time(ms)": 2.0, "Transit Time(ms)": 1.0, "Wait Time(ms)": 0.5}}
    path = tmp_path / "cluster_communication.json"
    path.write_text(
        json.dumps(
            {
                "(0, 1)": {
                    "step1": {
                        "collective": {
                            "hcom_allReduce__1@g": {"0": info, "1": info},
                            "Total Op Info@(0, 1)": {"0": info, "1": info},
                        }
                    }
                }
            }
        )
    )
    per_rank = _cluster_comm(path)
    assert {r: [op.name for op in ops] for r, ops in per_rank.items()} == {
        0: ["hcom_allReduce__1@g"],
        1: ["hcom_allReduce__1@g"],
    }


# --- 11. evaluate loads an AMCT artifact without torchao ---------------------------------------------------------


def test_amct_artifact_loads_and_registers_without_torchao(tmp_path):
    import torch

    from tasks.quant.artifact import META, WEIGHTS

    from tasks.fsutil import sha256_file

    torch.save(torch.nn.Linear(4, 4), tmp_path / WEIGHTS)
    meta = {"format": "torch_module", "backend": "amct", "model_dir": "x"}
    meta.update(int8_bytes=(tmp_path / WEIGHTS).stat().st_size, weights_sha256=sha256_file(tmp_path / WEIGHTS))
    (tmp_path / META).write_text(json.dumps(meta))  # what the quantize stage records beside AMCT's pickle
    code = (
        "import sys; sys.modules['torchao'] = None\n"  # any `import torchao` now raises ImportError
        # the Ascend host that quantized it has AMCT (a pickled deploy module is opened only there)
        "import types; sys.modules['amct_pytorch'] = types.ModuleType('amct_pytorch')\n"
        "from tasks.quant.artifact import load_quantized, pip_requirements\n"
        f"m = load_quantized({str(tmp_path)!r})\n"
        "print(type(m).__name__, pip_requirements({'backend': 'amct'})[0].split('==')[0])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["Linear", "torch"]


# --- 12. version files: ranges and lists ------------------------------------------------------------------------


def test_version_ranges_and_lists(tmp_path):
    assert versions.parse_ranges("[6.4.0,6.4.99],[7.0.0,8.9.9]") == [["6.4.0", "6.4.99"], ["7.0.0", "8.9.9"]]
    assert versions.parse_ranges("[V100R001C13,V100R001C19],[V100R001C30]") == [
        ["V100R001C13", "V100R001C19"],
        ["V100R001C30", "V100R001C30"],
    ]
    drv = tmp_path / "driver"
    drv.mkdir()
    (drv / "version.info").write_text(
        "Version=25.2.0\nInnerversion=V100R001C17SPC001B220\n"
        "compatible_version=[V100R001C30],[V100R001C13]\n"
        "compatible_version_fw=[6.4.0,6.4.99],[7.0.0,8.9.9]\n"
    )
    driver = versions.find_driver(tmp_path)
    # the firmware check must not disappear for a two-range driver
    c = compat.check_firmware(driver, {"version": "7.8.0.2.212"})
    assert c is not None and c["status"] == "ok"
    assert compat.check_firmware(driver, {"version": "6.5.0.1"})["status"] == "fail"
    cann = {
        "version": "8.3.RC2",
        "compatible_version": versions.parse_ranges(
            "compatible_version=[V100R001C13,V100R001C19],[V100R001C30]".split("=", 1)[1]
        ),
    }
    assert compat.check_driver_cann(driver, cann)["status"] == "ok"  # C17 is inside [C13, C19]
    driver["innerversion"] = "V100R001C23SPC001"
    assert compat.check_driver_cann(driver, cann)["status"] == "warn"


def test_entrypoint_sources_versioned_cann_dir(tmp_path):
    for v in ("8.5.0", "9.1.0"):
        (tmp_path / f"cann-{v}").mkdir()
        (tmp_path / f"cann-{v}" / "set_env.sh").write_text(f"export ASCEND_HOME_PATH=/opt/cann-{v}\n")
    proc = subprocess.run(
        ["bash", str(REPO / "docker" / "entrypoint-ascend.sh"), "bash", "-c", "echo $ASCEND_HOME_PATH"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "ASCEND_INSTALL_ROOT": str(tmp_path), "ASCEND_HOME_PATH": "", "ASCEND_TOOLKIT_HOME": ""},
    )
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
    assert system.check_clock(clock, 1, 500, 10)["status"] == "ok"  # one node: no cross-node timeline
    from tasks.config import HardwareConfig

    assert (HardwareConfig().warn_clock_offset_ms, HardwareConfig().max_clock_offset_ms) == (10.0, 500.0)


def test_allreduce_rule_at_30_percent_and_25_percent_note():
    from tasks.profiling.advisor import THRESHOLDS, advise

    def report(share):
        return {
            "step": {
                "shares": {"busy": 0.9, "comm_not_overlapped": 0.0, "bubble": 0.0},
                "allreduce_share": share,
                "allreduce_us_per_step": share * 1000,
                "step_us": 1000,
                "free_us": 0,
            },
            "ai_cpu_ops": [],
            "slow_ranks": {},
        }

    assert (THRESHOLDS["allreduce_max"], THRESHOLDS["allreduce_note"]) == (0.30, 0.25)
    assert [(f["rule"], f["severity"]) for f in advise(report(0.27))] == [("communication.allreduce_note", "low")]
    assert [f["rule"] for f in advise(report(0.35))] == ["communication.allreduce"]
    assert advise(report(0.20)) == []


def test_hccl_exec_timeout_help_names_the_long_checkpoint_advice():
    import inspect

    from tasks import config

    src = inspect.getsource(config.HardwareConfig)
    assert "1836" in src and "3600" in src and "checkpoint" in src


# --- 6. under msprof the trainer does not start torch_npu.profiler; msprof's PROF_* output is analysed -------------


def test_under_msprof_npu_profiler_is_not_started(tmp_path, monkeypatch):
    from tasks.config import ProfileConfig
    from tasks.profiling import collect

    monkeypatch.setenv("PROFILER_SAMPLECONFIG", '{"output": "/tmp/x"}')
    # no torch_npu here: starting torch_npu.profiler would raise BackendUnavailable
    prof = collect.make_profiler(ProfileConfig(), "npu", tmp_path / "traces", rank=0)
    with prof as p:
        p.step()
    assert isinstance(prof, collect._Off) and collect.under_msprof()


def test_msprof_run_is_analysed_from_its_prof_folder(tmp_path):
    from tasks.errors import StageError
    from tasks.stages.profile import msprof_source

    with pytest.raises(StageError, match="wrote no PROF_\\* folder"):
        msprof_source(tmp_path / "msprof")
    fixture = REPO / "tests" / "fixtures" / "profiling" / "msprof_new_healthy"
    assert msprof_source(fixture) == fixture


# --- 8. profiler options valid for the installed version --------------------------------------------------------


def test_profiler_options_checked_against_the_installed_release():
    from tasks.config import ProfileConfig
    from tasks.envcheck.compat import torchnpu_release
    from tasks.profiling.collect import npu_option_problems, release_key

    assert torchnpu_release("2.1.0.post8") == "6.0.rc3" and torchnpu_release("2.12.0") == "26.1.0"
    assert release_key("6.0.rc2") < release_key("6.0.rc3") < release_key("6.0.0") < release_key("7.0.0")
    errors, _ = npu_option_problems(ProfileConfig(npu_level="Level_none"), "26.1.0", {})
    assert errors and "no step breakdown" in errors[0]
    errors, _ = npu_option_problems(ProfileConfig(aic_metrics="MemoryAccess"), torchnpu_release("2.4.0.post2"), {})
    assert errors == [
        "profile.aic_metrics MemoryAccess needs TorchNPU 7.0.0 or newer; the installed torch_npu is "
        "TorchNPU 6.0.0: choose another profile.aic_metrics"
    ]
    assert npu_option_problems(ProfileConfig(aic_metrics="MemoryAccess"), "7.0.0", {}) == ([], [])
    errors, _ = npu_option_problems(ProfileConfig(aic_metrics="AiCoreNone"), torchnpu_release("2.2.0"), {})
    assert errors and "TorchNPU 6.0.rc2" in errors[0]
    _, warnings = npu_option_problems(ProfileConfig(), "26.1.0", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"})
    assert warnings and "not support it together with profiling" in warnings[0]


# --- 9. the AMCT flow chosen by what the package exposes, the supported pair named --------------------------------


def test_amct_flow_by_what_the_package_exposes():
    import types

    from tasks.errors import StageError
    from tasks.quant.amct_backend import available_flows, require_flow

    llm_only = types.ModuleType("amct_pytorch")  # hicann/amct 8.5.0's public names
    llm_only.quantize = llm_only.convert = lambda *a, **k: None
    assert available_flows(llm_only) == {"llm": True, "ptq": False, "qat": False}
    with pytest.raises(
        StageError,
        match=r"does not offer the ptq flow \(no amct_pytorch.create_quant_config\); "
        r"it offers: llm",
    ) as e:
        require_flow(llm_only, "ptq")
    # hicann/amct branches 9.0.0 and 9.1.0 have the classic flow (create_quant_config …), not only master.
    assert "9.0.0 or later: hicann/amct branches 9.0.0, 9.1.0" in str(e.value) and "master" not in str(e.value)

    lazy = types.ModuleType("amct_pytorch")  # master: classic names behind a failing __getattr__
    lazy.quantize = lazy.convert = lambda *a, **k: None

    def missing_dep(name):
        raise ImportError("No module named 'onnx'")

    lazy.__getattr__ = missing_dep
    assert available_flows(lazy)["ptq"] is False


def test_env_stage_names_the_amct_pair():
    c = compat.check_amct("9.0.0", "2.12.0", "2.12.0", "9.1.0")
    assert c["status"] == "warn" and "torch 2.1.0 or 2.7.1" in c["detail"] and "CANN >= 8.5.0" in c["detail"]
    assert compat.check_amct("9.0.0", "2.7.1+cpu", "2.7.1.post4", "9.0.0")["status"] == "ok"
    assert compat.check_amct("9.0.0", "2.7.1+cpu", "2.7.1.post4", "8.3.RC1")["status"] == "warn"
    assert compat.check_amct(None, "2.13.0", None, None) is None


def test_amct_check_agrees_with_the_stack_check_on_cann_8_5_0():
    """AMCT's pin (torch 2.7.1+cpu, torch_npu 2.7.1.post4) on CANN 8.5.0: the stack check failed ("requires CANN
    9.0.0", Ascend/pytorch COMPATIBILITY.en.md) while the amct check said ok (AMCT's own floor, CANN >= 8.5.0,
    hicann/amct README). Both are true: the amct check now also holds torch_npu to the installed CANN's build and
    names it."""
    m = compat.load_matrix()
    stack = compat.check_npu_stack(m, "2.7.1+cpu", "2.7.1.post4", "8.5.0")
    assert stack["status"] == "fail" and "requires CANN 9.0.0" in stack["detail"]
    c = compat.check_amct("9.0.0", "2.7.1+cpu", "2.7.1.post4", "8.5.0", m)
    assert c["status"] == "warn"
    assert (
        "torch_npu 2.7.1.post4, the CANN 9.0.0 build, on CANN 8.5.0: pip install torch-npu==2.7.1.post2" in c["detail"]
    )
    assert compat.check_npu_stack(m, "2.7.1+cpu", "2.7.1.post2", "8.5.0")["status"] == "ok"
    assert compat.check_amct("8.5.0", "2.7.1+cpu", "2.7.1.post2", "8.5.0", m)["status"] == "ok"
    assert compat.check_amct("9.0.0", "2.7.1+cpu", "2.7.1.post4", "9.0.0", m)["status"] == "ok"


# --- 10. AMCT PTQ: one device, export-friendly attention, fp32 refused, int8_dynamic is per-token ------------------


def _debug_model():
    import torch

    from tasks.model import build_model, materialize
    from tasks.model.config import get_preset

    c = get_preset("debug")
    m = build_model(c, "meta")
    materialize(m, torch.device("cpu"), 0)
    return c, m.eval()


def test_export_friendly_attention_matches_sdpa_and_exports_at_opset_11():
    import io
    import warnings

    import torch

    from tasks.quant.export import MathAttention, export_friendly

    c, m = _debug_model()
    x = torch.randint(0, c.vocab_size, (2, 16))
    with torch.no_grad():
        ref = m(x)
        with export_friendly(m):
            assert all(type(b.attention) is MathAttention for b in m.layers.values())
            out = m(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert all(type(b.attention).__name__ == "Attention" for b in m.layers.values())  # restored

    def export():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(m, (x,), io.BytesIO(), opset_version=11, dynamo=False)

    with pytest.raises(Exception, match="scaled_dot_product_attention.* opset version 11"):
        export()
    with export_friendly(m):
        try:
            export()
        except Exception as e:  # this venv has no `onnx` package: the graph converted, only serialising is left
            assert "onnx is not installed" in str(e), e


def test_ptq_keeps_sample_and_calibration_on_the_models_device(monkeypatch, tmp_path):
    """A recording stand-in for AMCT's classic API (hicann/amct master signatures): the model sits on `meta`, so any
    CPU tensor handed to it fails."""
    import torch

    from tasks.quant import amct_backend
    from tests.helpers.amct import fake_amct_ptq

    c, m = _debug_model()
    m.to("meta")
    seen = {}

    def on_config(config_file, model, input_data):
        seen["attention"] = type(model.layers["0"].attention).__name__
        seen["sample"] = input_data[0].device.type

    fake = fake_amct_ptq(on_config)
    monkeypatch.setitem(sys.modules, "amct_pytorch", fake)
    batches = [(torch.randint(0, c.vocab_size, (2, 8)), None) for _ in range(2)]
    out = amct_backend.quantize_ptq(m, [], batches, tmp_path, torch.device("meta"))
    assert seen == {"attention": "MathAttention", "sample": "meta"} and Path(out["deploy_onnx"]).is_file()


def test_amct_refuses_fp32_and_int8_dynamic_is_per_token():
    from tasks.errors import StageError
    from tasks.quant.amct_config import llm_quant_config
    from tasks.quant.plan import choose_backend

    with pytest.raises(StageError, match="quantize.dtype fp32: AMCT's INT8 quantization supports fp16/bf16"):
        choose_backend("amct", None, "npu", "llm", "fp32")
    assert choose_backend("amct", None, "npu", "llm", "fp16") == "amct"
    assert llm_quant_config("int8_dynamic", [])["quant_cfg"]["inputs"]["strategy"] == "token"
    assert llm_quant_config("smoothquant", [])["quant_cfg"]["inputs"]["strategy"] == "tensor"


def test_msprof_analyze_refusal_with_exit_0_is_not_ok(tmp_path, monkeypatch):
    """cluster_analysis.py logs "The current folder contains both DB and other files" and returns normally."""
    from tasks.profiling.msprof import run_msprof_analyze

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "msprof-analyze"
    exe.write_text("#!/bin/sh\necho '[ERROR] The current folder contains both DB and other files. Please check.'\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = run_msprof_analyze(tmp_path, tmp_path / "out")
    assert r["status"] == "skipped" and "both db and text" in r["reason"]
