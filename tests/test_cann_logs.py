"""CANN logs and error codes: collection into <run-dir>/<stage>/cann-logs/ (bounded), the error-code table, the
stage's one-line cause naming the code and fix, and the log-level switches passed to ranks."""

import os
import time

import pytest

from tasks import device, runner
from tasks.config import load_config
from tasks.envcheck import cann_logs
from tasks.errors import StageError

# The exact text torch_npu/CANN print (sources in cann_error_codes.yaml).
EI0006_LOG = (
    "[ERROR] 2025-07-01-00:40:04 (PID:176930, Device:0, RankID:-1) ERR01100 OPS call acl api failed.\n"
    "EI0006: [PID: 176930] 2025-07-01-00:40:04.135.732 Getting socket times out. Reason: Remote Rank did "
    "not send the data in time. Please check the reason for the rank being stuck\n"
)
EL0004_LOG = (
    "[ERROR] RecentErrMsg: [PID: 1604822] 2026-03-24-12:13:53.809.770 Memory_Allocation_Failure(EL0004): "
    "Failed to allocate memory.\n        Possible Cause: Available memory is insufficient.\n"
)


def test_table_is_complete_data():
    table = cann_logs.error_codes()
    for code in ("E10001", "EI0006", "EE9999", "EL0004", "EE1001", "E19999", "EI0002", "EH9999"):
        row = table[code]
        assert row["cause"] and row["fix"] and row["source"] and isinstance(row["verified"], bool), code


def test_ei0002_names_the_exec_timeout_the_project_sets():
    from tasks.config import HardwareConfig

    line = cann_logs.explain("EI0002")
    assert f"sets {HardwareConfig().hccl_exec_timeout} s" in line and "(default 1800 s)" not in line


def test_codes_found_in_both_print_styles_and_not_in_words():
    assert cann_logs.find_codes(EI0006_LOG) == ["EI0006"]
    assert cann_logs.find_codes(EL0004_LOG) == ["EL0004"]
    assert cann_logs.find_codes("EZ1234: something; then EI0002:") == ["EI0002", "EZ1234"]
    assert cann_logs.find_codes("id eeee1001-0001 and TEI00062 and BEE1001x") == []
    assert "not in tasks/envcheck/cann_error_codes.yaml" in cann_logs.explain("EZ1234")
    line = cann_logs.explain("EI0006")
    assert line.startswith("CANN EI0006 (Communication_Error_Get_Socket):") and "fix:" in line and "\n" not in line


def _plog(root, name, text, mtime=None):
    p = root / "debug" / "plog" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    if mtime:
        os.utime(p, (mtime, mtime))
    return p


def test_collect_takes_only_new_logs_bounded(tmp_path):
    root = tmp_path / "ascend-log"
    env = {"ASCEND_PROCESS_LOG_PATH": str(root)}
    start = time.time()
    _plog(root, "plog-1_old.log", "old run\n", mtime=start - 3600)
    _plog(root, "plog-2_new.log", "x" * 5000 + EI0006_LOG)
    dev = root / "debug" / "device-0" / "device-2_new.log"
    dev.parent.mkdir(parents=True)
    dev.write_text("y" * 5000)
    m = cann_logs.collect(tmp_path / "out", start - 1, max_bytes=6000, env=env, per_file=4000)
    kept = {os.path.basename(c["path"]): c for c in m["copied"]}
    assert "plog-1_old.log" not in kept and m["bytes"] <= 6000
    assert sum(c["kept_bytes"] for c in m["copied"]) == m["bytes"] and any(c["truncated"] for c in m["copied"])
    assert (tmp_path / "out" / "manifest.json").is_file()
    # the tail is kept: the error at the end of a long plog survives truncation
    plog_copy = tmp_path / "out" / "debug" / "plog" / "plog-2_new.log"
    if plog_copy.is_file():
        assert "EI0006" in plog_copy.read_text()
    assert cann_logs.collect(tmp_path / "none", time.time() + 60, 1000, env=env)["copied"] == []
    assert not (tmp_path / "none").exists()


class _Boom:
    def __init__(self, text, exc=StageError):
        self.text, self.exc = text, exc

    def run(self, cfg, ctx):
        (ctx.run_dir / "logs").mkdir(exist_ok=True)
        (ctx.run_dir / "logs" / "rank-1.log").write_text(self.text)
        raise self.exc("rank 1 died at step 4; see logs/rank-1.log")


@pytest.mark.parametrize("text,code", [(EI0006_LOG, "EI0006"), (EL0004_LOG, "EL0004")])
def test_failed_stage_names_the_code_and_fix_and_keeps_cann_logs(tmp_path, monkeypatch, text, code):
    root = tmp_path / "ascend-log"
    monkeypatch.setenv("ASCEND_PROCESS_LOG_PATH", str(root))
    _plog(root, "plog-9_now.log", text)
    monkeypatch.setattr(runner, "stage_module", lambda stage: _Boom(text))
    cfg = load_config("ci-tiny", sets=["tracking.enabled=false"])
    with pytest.raises(StageError) as err:
        runner.run_stage("train", cfg, tmp_path / "run")
    msg = str(err.value)
    assert msg.startswith("rank 1 died at step 4") and f"CANN {code} (" in msg and "fix:" in msg
    assert str(tmp_path / "run" / "train" / "cann-logs") in msg and "\n" not in msg
    assert (tmp_path / "run" / "train" / "cann-logs" / "debug" / "plog" / "plog-9_now.log").is_file()
    record = (tmp_path / "run" / "train.json").read_text()
    assert code in record


def test_cpu_failure_without_cann_logs_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_PROCESS_LOG_PATH", str(tmp_path / "nothing"))
    monkeypatch.setattr(runner, "stage_module", lambda stage: _Boom("plain python error\n"))
    cfg = load_config("ci-tiny", sets=["tracking.enabled=false"])
    with pytest.raises(StageError) as err:
        runner.run_stage("train", cfg, tmp_path / "run")
    assert str(err.value) == "rank 1 died at step 4; see logs/rank-1.log"
    assert not (tmp_path / "run" / "train" / "cann-logs").exists()


def test_log_level_switches_reach_the_ranks(monkeypatch):
    monkeypatch.delenv("ASCEND_GLOBAL_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ASCEND_SLOG_PRINT_TO_STDOUT", raising=False)
    cfg = load_config("ci-tiny", sets=["hardware.ascend_log_level=1", "hardware.ascend_log_stdout=true"])
    env = device.launch_env(device.Backend("npu", "hccl", 8), cfg.hardware)
    assert env["ASCEND_GLOBAL_LOG_LEVEL"] == "1" and env["ASCEND_SLOG_PRINT_TO_STDOUT"] == "1"
    default = load_config("ci-tiny")
    assert "ASCEND_GLOBAL_LOG_LEVEL" not in device.launch_env(device.Backend("npu", "hccl", 8), default.hardware)
    assert "ASCEND_GLOBAL_LOG_LEVEL" not in device.launch_env(device.Backend("cpu", "gloo", 2), cfg.hardware)
    with pytest.raises(Exception, match="ascend_log_level"):
        load_config("ci-tiny", sets=["hardware.ascend_log_level=7"])
