"""Operator-script leftovers: `make ui`'s pid files trusted by pid alone, and `make bench` / `make npu-api` creating
a relative LLM_PIPELINE_VAR_DIR's logs/ in the checkout."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.make import REPO
from tests.helpers.ports import free_port

OURS = ("AIRFLOW", "MLFLOW", "LLM_PIPELINE", "UI_", "STOP_")
MAKE_VARS = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OURS) and k not in MAKE_VARS and k != "BENCH"}
    return {**env, **extra}


def _script(script: str, var: Path, **extra: str) -> subprocess.CompletedProcess:
    env = _env(LLM_PIPELINE_VAR_DIR=str(var), **extra)
    return subprocess.run(["bash", str(REPO / "scripts" / script)], cwd=var.parent, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _pid_live(pidfile: Path) -> bool:
    """scripts/pidfile.sh's check, the one ui.sh, stop.sh and clean.sh make, on its own."""
    check = f'source "{REPO}/scripts/pidfile.sh"; pid_live "$1"'
    return subprocess.run(["bash", "-c", check, "_", str(pidfile)], timeout=30).returncode == 0


@pytest.fixture
def foreign():
    """A live process that `make ui` did not start (what holds the recorded pid after a reboot), its own group."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    time.sleep(0.05)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_pid_file_whose_pid_is_another_program_now_is_stale_for_ui_and_stop(tmp_path, foreign):
    """After a reboot gave `make ui`'s old pid to another program, `make ui` refused for ever ("already running";
    `make stop` first) and `make stop` signalled that program."""
    var = tmp_path / "var"
    var.mkdir()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    pidfile = var / "airflow.pid"
    # What ui.sh writes (pid, start, boot) for the very process: live. Then the same pid with another start (the pid
    # was reused) and a pid-only file (an older ui.sh's) written before the process began: stale.
    subprocess.run(["bash", "-c", f'source "{REPO}/scripts/pidfile.sh"; pid_write "$1" "$2"', "_", str(pidfile),
                    str(foreign.pid)], check=True, timeout=30)  # fmt: skip
    assert _pid_live(pidfile), pidfile.read_text()
    reused = f"{foreign.pid}\n1 {boot}\n"
    pidfile.write_text(reused)
    assert not _pid_live(pidfile)
    legacy = var / "mlflow.pid"
    legacy.write_text(f"{foreign.pid}\n")
    assert _pid_live(legacy)  # written after the process began: the one that was started
    before = time.time() - 3600
    os.utime(legacy, (before, before))
    assert not _pid_live(legacy)

    # make ui: one line per stale file, replaced; it goes on to its next check (a busy port here: no server starts).
    ml_port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ml_port))
        busy.listen()
        out = _script("ui.sh", var, AIRFLOW_PORT=str(free_port()), MLFLOW_PORT=str(ml_port))
    assert out.returncode == 1 and not out.stdout, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[:2] == [
        f"ui: {var}/{name}.pid is stale (pid {foreign.pid} is no longer the {name} make ui started: it exited, or the "
        "host rebooted): replacing it"
        for name in ("airflow", "mlflow")
    ], lines
    assert lines[2].startswith(f"ui: MLFLOW_PORT={ml_port}: ") and len(lines) == 3, lines
    assert not pidfile.exists() and not legacy.exists()

    # make stop: nothing signalled, the stale files removed.
    pidfile.write_text(reused)
    legacy.write_text(f"{foreign.pid}\n")
    os.utime(legacy, (before, before))
    out = _script("stop.sh", var, STOP_WAIT_S="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        f"stop: {name} not running (stale pid {foreign.pid}: not the {name} make ui started; nothing signalled)"
        for name in ("airflow", "mlflow")
    ]
    time.sleep(0.2)
    assert foreign.poll() is None, "make stop signalled a process make ui did not start"
    assert not pidfile.exists() and not legacy.exists()


def test_stop_still_stops_the_group_whose_recorded_process_exited(tmp_path):
    """The recorded process gone (same boot), its group left running: still make ui's, so make stop stops it."""
    var = tmp_path / "var"
    var.mkdir()
    leader = subprocess.Popen(["bash", "-c", "sleep 120 & read -r _"], stdin=subprocess.PIPE, start_new_session=True)
    try:
        subprocess.run(["bash", "-c", f'source "{REPO}/scripts/pidfile.sh"; pid_write "$1" "$2"', "_",
                        str(var / "mlflow.pid"), str(leader.pid)], check=True, timeout=30)  # fmt: skip
        leader.communicate(b"\n", timeout=30)  # the leader exits, its `sleep` stays in the group
        out = _script("stop.sh", var, STOP_WAIT_S="0")
        assert out.returncode == 0 and "stop: mlflow stopped" in out.stdout, out.stdout + out.stderr
        deadline = time.time() + 10
        while time.time() < deadline and _group_alive(leader.pid):
            time.sleep(0.1)
        assert not _group_alive(leader.pid)
    finally:
        if _group_alive(leader.pid):
            os.killpg(leader.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    ps = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True, check=True).stdout
    return any(f.split()[0] == str(pgid) and not f.split()[1].startswith("Z") for f in ps.splitlines() if f.strip())


@pytest.mark.parametrize("target", ["bench", "npu-api"])
def test_make_bench_and_npu_api_refuse_a_relative_var_dir_before_creating_it(tmp_path, target):
    """Only make run / make db refused a relative LLM_PIPELINE_VAR_DIR: bench and npu-api created <it>/logs/ (and an
    airflow.db) in the checkout, through scripts/airflow-env.sh."""
    rel = f"var-ops-leftovers-{os.getpid()}-{target}"
    # Should the check be missing, each stops fast: an unknown bench, an AMCT dir that is none (before any download).
    env = _env(LLM_PIPELINE_VAR_DIR=rel, BENCH="no-such-bench", AMCT_GIT_DIR=str(tmp_path / "nope"))
    try:
        proc = subprocess.Popen(["make", "-s", target], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"make {target} was still running after 120 s")
        assert proc.returncode == 2, out + err
        assert [ln for ln in err.strip().splitlines() if not ln.startswith("make: ***")] == [
            f"error: LLM_PIPELINE_VAR_DIR={rel} is a relative path (each process would read it from its own working "
            f"directory); give an absolute one, e.g. LLM_PIPELINE_VAR_DIR=$PWD/{rel}"
        ], err
        assert not (REPO / rel).exists()
    finally:
        shutil.rmtree(REPO / rel, ignore_errors=True)
