"""Env and health stages against the audit's findings: a failed npu-smi/nvidia-smi is not a CPU host, chips (not
cards) are counted, hccn_tool is asked about the NPUs npu-smi lists, a wrong --ascend-root / rdzv_endpoint is one
line, compatibility within a release line, the clock warning threshold, $ASCEND_HOME_PATH, one-rank probes.

npu-smi, nvidia-smi and hccn_tool are stand-in scripts on PATH printing the real tools' fixture text (as
tests/test_env_stage.py and tests/test_health.py do)."""

import argparse
import os
import socket
from pathlib import Path

import pytest

from tasks import npu_smi
from tasks.config import load_config
from tasks.envcheck import compat, network, system
from tasks.errors import ConfigError, StageError
from tasks.stages import env, health

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
ENV = FIX / "env"
DCMI = "dcmi module initialize failed. ret is -8005"


def tool(bin_dir: Path, name: str, body: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / name
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return bin_dir


def by_name(checks):
    return {c["name"]: c for c in checks}


def chips_sample(name: str) -> dict:
    return {
        "host": {"memory_available_gb": 900.0, "memory_total_gb": 1024.0},
        "npu_smi": npu_smi.parse((ENV / "npu-smi" / name).read_text()),
        "backend": {"kind": "npu", "device_count": 4},
        "clock": system.parse_chronyc((ENV / "chronyc-tracking.txt").read_text()),
        "disk_paths": {"var": str(REPO)},
    }


# 1 -- a failed or missing tool on a host that has (or had) devices ------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_failing_npu_smi_with_expected_devices_is_an_alarm(cfg, tmp_path, monkeypatch, device):
    bin_dir = tool(tmp_path / "bin", "npu-smi", f'echo "{DCMI}" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", str(bin_dir))  # no nvidia-smi either
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    assert npu_smi.query() == (None, f"exit 1: {DCMI}")
    cfg.hardware.device = device
    cfg.hardware.expected_devices = 8
    sample = health.collect(cfg)
    dev = by_name(health.assess(sample, cfg))["devices"]
    assert dev["status"] == "fail", dev
    assert dev["detail"].startswith(f"npu-smi failed (exit 1: {DCMI}); 8 devices expected (hardware.expected_devices)")


def test_failing_nvidia_smi_against_the_remembered_count_is_an_alarm(cfg, tmp_path, monkeypatch):
    bin_dir = tool(tmp_path / "bin", "nvidia-smi", 'echo "NVIDIA-SMI has failed" >&2\nexit 9\n')
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    dev = by_name(health.assess(health.collect(cfg), cfg, last_seen=2))["devices"]
    assert dev["status"] == "fail"
    assert dev["detail"].startswith("nvidia-smi failed (exit 9: NVIDIA-SMI has failed); 2 devices expected (seen on")


def test_missing_tools_fail_only_where_devices_are_expected(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither tool
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    sample = health.collect(cfg)
    assert "devices" not in by_name(health.assess(sample, cfg))  # a CPU host that never had devices
    dev = by_name(health.assess(sample, cfg, last_seen=8))["devices"]
    assert dev["status"] == "fail" and dev["detail"].startswith(
        "neither npu-smi nor nvidia-smi is installed; 8 devices"
    )


def test_health_stage_with_a_failing_npu_smi_and_a_remembered_count_raises(cfg, tmp_path, monkeypatch):
    """End to end through the runner (what `python -m tasks health` does): not 'ok'."""
    from tasks.fsutil import atomic_write_json

    bin_dir = tool(tmp_path / "bin", "npu-smi", f'echo "{DCMI}" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    atomic_write_json(health.state_path(), {"max_devices": 8, "time": 0})
    cfg.tracking.enabled = False
    cfg.hardware.min_host_memory_gb = cfg.hardware.min_free_disk_gb = 0.01
    with pytest.raises(StageError, match=r"^health alarm: devices: npu-smi failed \(exit 1: dcmi"):
        health.run_health(cfg, tmp_path / "run")


# 2 -- chips, not cards ---------------------------------------------------------------------------------------------


def test_two_chip_cards_count_chips(cfg):
    sample = chips_sample("910-two-chips.txt")  # 2 cards × 2 chips (A3/910C layout)
    assert health.device_count(sample) == 4
    cfg.hardware.expected_devices = 4
    dev = by_name(health.assess(sample, cfg))["devices"]
    assert dev["status"] == "ok" and dev["detail"] == "4 NPU chips (npu-smi)"
    sample["npu_smi"]["chips"].pop()  # one die lost, both cards still listed
    dev = by_name(health.assess(sample, cfg))["devices"]
    assert dev["status"] == "fail" and "3 NPU chips (npu-smi) visible, 4 expected" in dev["detail"]


# 3 -- hccn_tool asks the NPUs npu-smi lists; a failing tool is a warning -----------------------------------------


def test_nic_devices_are_the_listed_npus():
    one = npu_smi.parse((ENV / "npu-smi" / "910b3-one-card.txt").read_text())["chips"]
    two = npu_smi.parse((ENV / "npu-smi" / "910-two-chips.txt").read_text())["chips"]
    assert env.nic_devices(one) == [3]
    assert env.nic_devices(two) == [0, 1, 2, 3]  # the Phy-IDs


def _network(tmp_path, monkeypatch, body: str, chips_fixture: str):
    bin_dir = tool(tmp_path / "bin", "hccn_tool", body)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = load_config("ci-tiny", sets=["tracking.enabled=false"])
    facts = {"npu_smi": npu_smi.parse((ENV / "npu-smi" / chips_fixture).read_text())}
    checks = []
    env._network_checks(cfg, "npu", facts, checks)
    return facts, by_name(checks)


def test_down_link_on_the_only_visible_npu_is_reported(tmp_path, monkeypatch):
    body = (
        f'if [ "$2" = 3 ] && [ "$3" = -link ]; then cat "{ENV / "hccn_tool" / "link-down.txt"}"; exit 0; fi\n'
        'echo "device $2 not found" >&2\nexit 1\n'
    )
    facts, checks = _network(tmp_path, monkeypatch, body, "910b3-one-card.txt")
    assert list(facts["network"]["nics"]) == [3]
    assert checks["nic-link"]["status"] == "warn" and "3" in checks["nic-link"]["detail"]


def test_hccn_tool_failing_everywhere_is_a_warning_naming_the_failure(tmp_path, monkeypatch):
    _, checks = _network(tmp_path, monkeypatch, 'echo "dsmi_get_device_info failed" >&2\nexit 1\n', "910b2c.txt")
    nic = checks["nic"]
    assert nic["status"] == "warn" and nic.get("severity") != "info"
    assert "failed on every device (0, 1; first: -i 0 -link: exit 1: dsmi_get_device_info failed)" in nic["detail"]
    assert network.NOT_AVAILABLE not in nic["detail"]


# 4 -- an --ascend-root that holds no Ascend install ---------------------------------------------------------------


@pytest.mark.parametrize(
    "given, parent",
    [(ENV / "ascend-cann" / "cann", ENV / "ascend-cann"), (ENV / "ascend-legacy" / "ascend-toolkit" / "latest", None)],
)
def test_a_toolkit_directory_as_ascend_root_names_its_parent(cfg, tmp_path, given, parent):
    from tasks.runner import run_stage

    parent = parent or ENV / "ascend-legacy"
    args = argparse.Namespace(no_probe=True, ascend_root=str(given))
    with pytest.raises(ConfigError) as err:
        run_stage("env", cfg, tmp_path / "run", args=args)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--ascend-root {given} is a CANN toolkit directory")
    assert f"--ascend-root {parent})" in msg and f"ASCEND_HOME_PATH={given}" in msg


def test_an_ascend_root_without_any_install_is_refused(cfg, tmp_path):
    from tasks.runner import run_stage

    (tmp_path / "usr-local" / "bin").mkdir(parents=True)
    args = argparse.Namespace(no_probe=True, ascend_root=str(tmp_path / "usr-local"))
    with pytest.raises(ConfigError, match=r"^--ascend-root .*/usr-local holds no Ascend install \(none of driver/"):
        run_stage("env", cfg, tmp_path / "run", args=args)
    env.check_ascend_root(str(ENV / "ascend-versioned"))  # cann-8.5.0: a real root
    env.check_ascend_root(str(ENV / "ascend-legacy"))


# 5 -- rdzv_endpoint ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["127.0.0.1:99999", "127.0.0.1:0", "::1:29400", "node0", "node0:"])
def test_a_bad_rdzv_endpoint_is_one_config_line(endpoint):
    with pytest.raises(ConfigError) as err:
        load_config("demo-cpu", sets=[f"hardware.rdzv_endpoint={endpoint}"])
    assert "hardware.rdzv_endpoint" in str(err.value) and "\n" not in str(err.value).strip()


def test_bracketed_ipv6_endpoint_is_accepted_and_checked():
    cfg = load_config("demo-cpu", sets=["hardware.rdzv_endpoint=[::1]:29400"])
    assert cfg.hardware.rdzv_endpoint == "[::1]:29400"
    assert network.rendezvous_check("127.0.0.1:99999", 1, 2)["status"] == "fail"  # no false ok on node 1
    assert network.rendezvous_check("127.0.0.1:99999", 0, 2)["status"] == "fail"  # no traceback on node 0
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no ::1 on this host")
    assert network.rendezvous_check("[::1]:29400", 1, 2)["status"] == "ok"
    assert network.rendezvous_check("[::1]:0", 1, 2)["status"] == "fail"


# 6 -- mismatch within a release line when the table has the installed CANN ----------------------------------------


@pytest.mark.parametrize(
    "torch_npu, cann, install",
    [
        ("2.1.0.post4", "8.0.0", "pip install torch==2.1.0 torch-npu==2.1.0.post10 (CANN 8.0.0)"),
        ("2.1.0.rc1", "7.0.0", "pip install torch==2.1.0 torch-npu==2.1.0 (CANN 7.0.0)"),
    ],
)
def test_same_line_mismatch_fails_when_the_table_has_the_installed_cann(torch_npu, cann, install):
    c = compat.check_npu_stack(compat.load_matrix(), "2.1.0", torch_npu, cann)
    assert c["status"] == "fail" and install in c["detail"], c


def test_same_line_cann_the_table_lacks_still_only_warns():
    c = compat.check_npu_stack(compat.load_matrix(), "2.1.0", "2.1.0.post4", "8.0.RC9")
    assert c["status"] == "warn" and "same release line" in c["detail"]


# 7, 8 -- health honours hardware.warn_clock_offset_ms and $ASCEND_HOME_PATH ----------------------------------------


def test_health_clock_uses_the_configured_warning_threshold(cfg):
    sample = chips_sample("910b2c.txt")
    sample["clock"] = {"offset_ms": 50.0, "synchronised": True, "source": "chronyc"}
    cfg.hardware.nnodes, cfg.hardware.node_rank = 2, 0
    cfg.hardware.warn_clock_offset_ms = 100.0
    assert by_name(health.assess(sample, cfg))["clock"]["status"] == "ok"
    cfg.hardware.warn_clock_offset_ms = 20.0
    clock = by_name(health.assess(sample, cfg))["clock"]
    assert clock["status"] == "warn" and "hardware.warn_clock_offset_ms 20" in clock["detail"]


def test_health_reads_cann_from_ascend_home_path(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(ENV / "ascend-versioned" / "cann-8.5.0"))
    assert health.collect(cfg)["versions"]["cann"] == "8.5.0"


# 9 -- a driver Innerversion that is not V…R…C… is not "compatible" --------------------------------------------------


def test_unparsable_driver_innerversion_is_not_checked():
    driver = {"version": "25.2.0", "innerversion": "25.2.0.B001", "compatible_firmware": []}
    cann = {"version": "8.5.0", "compatible_version": [["V100R001C25", "V100R001C25"]]}
    c = compat.check_driver_cann(driver, cann)
    assert c["status"] == "warn" and "'25.2.0.B001'" in c["detail"] and "not checked" in c["detail"]
    assert "is in CANN" not in c["detail"]


# 10 -- one rank: no link measured ---------------------------------------------------------------------------------


def test_one_rank_summary_says_no_link_measured():
    facts = {
        "versions": {"torch": "2.8.0+cpu"},
        "backend": {"kind": "cpu", "device_count": 2},
        "probe": {"world_size": 1, "allreduce_ok": True, "sizes": [{"size_mb": 1.0, "busbw_gbps": 0.0}]},
    }
    line = env._summary(facts)
    assert "one rank (no link measured)" in line and "GB/s" not in line
    facts["probe"]["world_size"] = 2
    assert "all_reduce ok 0.0 GB/s" in env._summary(facts)
