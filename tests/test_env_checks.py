"""npu-smi parsing over several chip generations, clock/HCCL/visible-device/host checks, probe judgement."""

from pathlib import Path

import pytest

from tasks import npu_smi
from tasks.envcheck import npu_health, probe, system, worst

ENV = Path(__file__).parent / "fixtures" / "env"


def smi(name):
    return npu_smi.parse((ENV / "npu-smi" / name).read_text())


def test_910b2c_hbm_and_processes():
    info = smi("910b2c.txt")
    assert info["version"] == "23.0.2.1" and len(info["chips"]) == 2
    c0 = info["chips"][0]
    assert (c0["npu"], c0["chip"], c0["name"], c0["health"]) == (0, 0, "910B2C", "OK")
    assert (c0["power_w"], c0["temp_c"], c0["bus_id"]) == (88.6, 51, "0000:5A:00.0")
    assert (c0["memory_kind"], c0["memory_used_mb"], c0["memory_total_mb"]) == ("HBM", 20701, 65536)
    assert info["chips"][1]["memory_used_mb"] == 20687
    assert info["processes"] == [{"npu": 0, "chip": 0, "pid": 124528, "name": "python3.8", "memory_mb": 17400}]
    statuses = {c["name"]: c["status"] for c in npu_health.checks(info)}
    assert statuses == {"npu-health": "ok", "npu-idle": "warn"}
    assert npu_smi.summary(info) == "2× 910B2C, 69 GB HBM each"  # 65536 MiB = 68.7 GB (tasks.units: GB = 1e9)


def test_910_two_chips_per_npu_with_phy_id():
    info = smi("910-two-chips.txt")
    ids = [(c["npu"], c["chip"], c["device_id"]) for c in info["chips"]]
    assert ids == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert info["chips"][1]["power_w"] is None  # "-": second chip reports no power
    assert info["chips"][3]["memory_used_mb"] == 10568
    assert [p["pid"] for p in info["processes"]] == [990711]  # "No running processes found" skipped


def test_310p3_ddr_without_hbm_column():
    info = smi("310p3.txt")
    assert len(info["chips"]) == 4 and {c["memory_kind"] for c in info["chips"]} == {"DDR"}
    assert (info["chips"][0]["memory_used_mb"], info["chips"][0]["memory_total_mb"]) == (16302, 44280)
    assert info["chips"][0]["power_w"] is None and info["chips"][2]["temp_c"] == 61
    assert len(info["processes"]) == 4


def test_310b4_alarm_fails_health():
    info = smi("310b4.txt")
    chip = info["chips"][0]
    assert (chip["name"], chip["health"], chip["bus_id"], chip["memory_total_mb"]) == ("310B4", "Alarm", "NA", 15609)
    health = npu_health.checks(info)[0]
    assert health["status"] == "fail" and "NPU 0 chip 0 (310B4) is Alarm" in health["detail"]


def test_910b3_single_visible_card():
    info = smi("910b3-one-card.txt")
    assert [(c["npu"], c["name"], c["memory_used_mb"]) for c in info["chips"]] == [(3, "910B3", 3198)]
    assert info["processes"] == [] and worst(npu_health.checks(info)) == "ok"


def test_clock_parsers_and_check():
    good = system.parse_chronyc((ENV / "chronyc-tracking.txt").read_text())
    assert good["offset_ms"] == pytest.approx(-0.001622) and good["synchronised"] is True
    assert system.check_clock(good, nnodes=4, max_offset_ms=500)["status"] == "ok"
    drift = system.parse_chronyc((ENV / "chronyc-tracking-drifted.txt").read_text())
    assert drift["offset_ms"] == pytest.approx(742.318005) and drift["synchronised"] is False
    c = system.check_clock(drift, nnodes=2, max_offset_ms=500)
    assert c["status"] == "fail" and "+742.3 ms" in c["detail"]
    assert system.check_clock(drift, nnodes=1, max_offset_ms=500)["status"] == "warn"  # single node: HCCL unaffected
    td = system.parse_timedatectl((ENV / "timedatectl-show.txt").read_text())
    assert td["synchronised"] is False and system.check_clock(td, 2, 500)["status"] == "fail"
    assert system.parse_timedatectl("System clock synchronized: yes")["synchronised"] is True
    unknown = {"source": None, "offset_ms": None, "synchronised": None}
    assert system.check_clock(unknown, 1, 500)["status"] == "ok"
    assert system.check_clock(unknown, 2, 500)["status"] == "warn"


def test_hccl_timeouts():
    assert system.check_hccl({"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "1836"}, "npu")["status"] == "ok"
    c = system.check_hccl({"HCCL_CONNECT_TIMEOUT": "60", "HCCL_EXEC_TIMEOUT": "abc"}, "npu")
    assert c["status"] == "fail" and "HCCL_CONNECT_TIMEOUT=60 outside [120, 7200]" in c["detail"]
    assert "HCCL_EXEC_TIMEOUT='abc' is not an integer" in c["detail"]
    c = system.check_hccl(
        {"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "1836", "HCCL_EVENT_TIMEOUT": "1800"}, "npu"
    )
    assert c["status"] == "warn" and "should exceed" in c["detail"]  # torch_npu only warns (EVENT <= EXEC)
    assert system.check_hccl({"HCCL_CONNECT_TIMEOUT": "60"}, "cpu")["status"] == "warn"


def test_visible_devices():
    assert system.parse_visible("0,1,2,3") == ([0, 1, 2, 3], None)
    ids, problem = system.parse_visible("1, 2,3")  # CANN stops at " 2": only device 1 is used
    assert ids == [1] and "' 2'" in problem
    assert system.parse_visible("2,1")[0] == [2]
    var = "ASCEND_RT_VISIBLE_DEVICES"
    assert system.check_visible("npu", var, "0,1,2,3", 4, 0, physical_count=8)["status"] == "ok"
    c = system.check_visible("npu", var, "1, 2,3", 1, 0)
    assert c["status"] == "fail" and "ascending ids without spaces" in c["detail"]
    c = system.check_visible("npu", var, "6,7,8", 3, 0, physical_count=8)
    assert c["status"] == "fail" and "names device 8 but the host has 8 NPUs" in c["detail"]
    c = system.check_visible("npu", var, None, 4, 8)
    assert c["status"] == "fail" and "nproc_per_node 8 exceeds the 4 visible NPUs" in c["detail"]
    assert system.check_visible("cuda", "CUDA_VISIBLE_DEVICES", "0,1", 4, 0)["status"] == "warn"
    assert system.check_visible("cpu", "", None, 2, 0)["detail"].startswith("cpu: 2 gloo ranks")


def test_host_memory_and_disk(tmp_path):
    assert system.check_host_memory(1.0, 16.0, 2.0)["status"] == "fail"
    assert system.check_host_memory(8.0, 16.0, 2.0)["status"] == "ok"
    check, free = system.check_disk({"shards": tmp_path / "not" / "yet" / "made"}, 0.001)
    assert check["status"] == "ok" and free["shards"] > 0
    check, _ = system.check_disk({"shards": tmp_path}, 1e9)
    assert check["status"] == "fail" and "below hardware.min_free_disk_gb" in check["detail"]
    host = system.host_facts()
    assert host["cores_usable"] >= 1 and host["memory_total_gb"] > 0


def _result(busbw, ok=True, world=8):
    return {
        "world_size": world,
        "backend": "hccl",
        "allreduce_ok": ok,
        "allreduce_max_error": 0.0 if ok else 3.0,
        "sizes": [{"size_mb": 256.0, "busbw_gbps": busbw, "algbw_gbps": busbw / 1.75, "seconds": 0.1}],
    }


def test_probe_judgement():
    assert [c["status"] for c in probe.judge(_result(46.0), "npu", 56.0)] == ["ok", "ok"]
    slow = probe.judge(_result(20.0), "npu", 56.0, "hardware.cluster 910b's intra-node figure")[1]
    assert slow["status"] == "warn"
    assert "below half the expected 56 GB/s (hardware.cluster 910b's intra-node figure)" in slow["detail"]
    assert probe.judge(_result(20.0), "npu", expected_bus_gbps=30.0)[1]["status"] == "ok"
    assert probe.judge(_result(1.0), "cpu")[1]["status"] == "ok"  # no expectation on CPU
    assert probe.judge(_result(46.0, ok=False), "npu")[0]["status"] == "fail"
    assert probe.judge({"error": "collective probe failed (torchrun exit 1): x"}, "cpu")[0]["status"] == "fail"
    argv = probe.command("cpu", 2, [1.0, 16.0], Path("/tmp/p.json"))
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in argv


def test_probe_expects_the_cluster_presets_link_figure():
    """The expected bus bandwidth was 910B's ~50 GB/s on every NPU cluster: a 910c node measuring 60 GB/s (under a
    third of the 196 GB/s per die its plan assumes) passed. Now: the cluster's intra-node figure (inter-node across
    nodes), hardware.* overrides first, none when the preset is not of the backend's kind."""
    from tasks.config import load_config

    one = load_config("llama3-70b-910c", sets=["hardware.nnodes=1"]).hardware
    assert probe.expected_bus("npu", one) == (196.0, "hardware.cluster 910c's intra-node figure")
    slow = probe.judge(_result(60.0), "npu", *probe.expected_bus("npu", one))[1]
    assert slow["status"] == "warn" and "below half the expected 196 GB/s (hardware.cluster 910c's" in slow["detail"]
    eight = load_config("llama3-70b-910c").hardware  # 8 nodes: the world's ring crosses the 25 GB/s RDMA ports
    assert probe.expected_bus("npu", eight) == (25.0, "hardware.cluster 910c's inter-node figure")
    b = load_config("qwen2-7b-910b").hardware
    assert probe.expected_bus("npu", b) == (56.0, "hardware.cluster 910b's intra-node figure")
    b.intra_node_gbps = 40.0
    assert probe.expected_bus("npu", b) == (40.0, "hardware.intra_node_gbps")
    b.expected_bus_gbps = 30.0
    assert probe.expected_bus("npu", b) == (30.0, "hardware.expected_bus_gbps")
    assert probe.expected_bus("cuda", load_config("qwen2-7b-910b").hardware) == (0.0, "")  # a 910b preset on CUDA
    assert probe.expected_bus("cpu", load_config("demo-cpu").hardware) == (0.0, "")


def test_bad_probe_sizes_are_a_config_error(cfg):
    from tasks.stages.env import probe_sizes
    from tasks.errors import ConfigError

    cfg.hardware.probe_sizes_mb = [1, 4.0]
    assert probe_sizes(cfg) == [1.0, 4.0]
    cfg.hardware.probe_sizes_mb = [4, "big"]
    with pytest.raises(ConfigError, match=r"hardware.probe_sizes_mb: \[4, 'big'\] must be positive"):
        probe_sizes(cfg)
