"""`make run` (real make, real bash, the real Makefile): CONF is data, never shell or make syntax; a bad CONF is one
line before Airflow starts; each invocation has its own log."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.make import REPO, make_run

PAYLOADS = [  # each would create `pwned` in the temp dir if it reached a shell or make's expansion
    "x'; touch {d}/pwned; echo '",
    '{{"preset": "x\'; touch {d}/pwned; echo \'"}}',
    "$(shell touch {d}/pwned)",
    "`touch {d}/pwned`",
    "$$(touch {d}/pwned)",
    '{{"preset": "$(touch {d}/pwned)"}}',
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_conf_never_reaches_a_shell(payload, tmp_path):
    out = make_run(payload.format(d=tmp_path), tmp_path)
    assert not (tmp_path / "pwned").exists(), f"CONF {payload!r} ran a command"
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if not ln.startswith("make: ***")]
    assert len(lines) == 1 and lines[0].startswith("error: CONF "), lines
    assert "is not JSON" in lines[0] or "unknown preset" in lines[0], lines[0]


@pytest.mark.slow
def test_two_make_runs_at_once_each_report_their_own_run(tmp_path, airflow_db):
    """Two `make run` at once (real make, real `airflow dags test`): each writes its own log and prints the summary of
    the run directory it made (here both stop at env: device npu on a CPU host); the second waits for the first
    (Airflow's metadata DB takes one `dags test` at a time) and says which run holds it. The overlap is made, not
    hoped for: the first is held (SIGSTOP) once it has the lock until the second says it waits (started together,
    a loaded CI host once let the first finish before the second reached the lock: neither waited, the test failed)."""
    import re
    import signal
    import threading

    env = {
        **os.environ,
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        # No store yet, as a user's first `make run` meets it (not a copy of the tests' migrated one).
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    for var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):  # a user's top-level make, even under make test
        env.pop(var, None)
    conf = '{"preset": "ci-tiny", "device": "npu"}'

    def start():
        return subprocess.Popen(
            ["make", "-s", "-o", "db", "run", f"CONF={conf}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: held and released as one
        )

    holder_file = tmp_path / "var" / "logs" / ".make-run.holder"
    first = start()
    second, second_lines, says_it_waits = None, [], threading.Event()
    try:
        deadline = time.monotonic() + 300
        while not holder_file.is_file() or not holder_file.read_text().endswith("\n"):
            assert first.poll() is None, f"the first make run ended before taking the lock: {first.communicate()[0]}"
            assert time.monotonic() < deadline, "the first make run never took the lock"
            time.sleep(0.1)
        holder = holder_file.read_text().strip()  # "pid <its script's pid>, log <its log>"
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            second = start()

            def read_second():
                for line in second.stdout:
                    second_lines.append(line)
                    if "waiting for the other make run" in line:
                        says_it_waits.set()

            reader = threading.Thread(target=read_second, daemon=True)
            reader.start()
            deadline = time.monotonic() + 300
            while not says_it_waits.wait(0.2) and reader.is_alive() and time.monotonic() < deadline:
                pass  # until it says it waits, or ends without having waited
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        first_out = first.communicate(timeout=900)[0]
        second.wait(timeout=900)
        reader.join(timeout=60)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    second_out = "".join(second_lines)
    assert says_it_waits.is_set(), second_out[-2000:]
    assert f"waiting for the other make run ({holder}) to finish" in second_out, second_out[-2000:]
    assert "waiting for the other make run" not in first_out, first_out[-2000:]
    runs, logs = [], []
    for p, out in ((first, first_out), (second, second_out)):
        assert p.returncode != 0, out[-2000:]
        m = re.search(r"Run directory: (\S+)  Log: (\S+)", out)
        assert m, out[-2000:]
        runs.append(m.group(1))
        logs.append(m.group(2))
        assert "torch_npu is not importable" in out  # the stage's cause is on screen
        assert Path(m.group(2)).is_file() and "env" in Path(m.group(2)).read_text()
    assert runs[0] != runs[1] and logs[0] != logs[1], (runs, logs)
    assert holder.startswith("pid ") and holder.endswith(f", log {logs[0]}"), (holder, logs)  # the first held it
    for run in runs:
        assert json.loads((Path(run) / "env.json").read_text())["status"] == "failed"


LOG = [  # airflow dags test's lines (structlog and the DAG-test runner), and what the screen shows of each
    ("[2026-12-03T05:00:00] {dag.py:1} INFO - [DAG TEST] starting task_id=train map_index=-1", "  … train"),
    (
        "2026-12-03T05:06:48Z [info     ] progress: train step 240/300 (80%), loss 3.774 [tasks.progress] loc=x.py:1",
        "    progress: train step 240/300 (80%), loss 3.774",
    ),
    (
        "2026-12-03T05:06:48Z [error    ] train: rank 1 died (exit code 1) [tasks.pipeline] loc=pipeline.py:3",
        "  ! train: rank 1 died (exit code 1)",
    ),
    ("2026-12-03T05:06:48Z [info     ] Waiting for Human-in-the-loop input for task approve", "  ? the approve task"),
    ("2026-12-03T05:06:49Z [info     ] Waiting for Human-in-the-loop input for task approve", None),  # said once
    ("2026-12-03T05:06:50Z [info     ] loading the checkpoint [tasks.train] loc=x.py:2", None),
]


def test_the_screen_shows_each_line_as_it_arrives():
    """make run's screen filter (scripts/screen_filter.py) prints a task start, a progress line, a failure's cause and
    the approval hint each while its input is still open: a filter that reads its pipe in blocks (mawk, Debian's awk)
    held them back until ~4 KB more log had come, minutes into a run."""
    import select
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-u", str(REPO / "scripts" / "screen_filter.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line, shown in LOG:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            if shown is None:
                continue
            # a bound on a hung filter, not a timing: the line must come while stdin stays open
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, f"{line!r}: not on screen while the log is still open"
            assert proc.stdout.readline().rstrip("\n").startswith(shown)
        proc.stdin.close()
        assert proc.stdout.read() == ""  # the lines without a screen form printed nothing
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_make_clean_removes_the_var_dir_in_use_and_never_one_outside_the_checkout(tmp_path):
    """`make clean` follows LLM_PIPELINE_VAR_DIR as `make run` does; a var dir outside the checkout (a mistyped
    variable could name a home directory) or holding the code (tasks, .git) is kept, in one line saying how to
    remove it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    outside = tmp_path / "var"
    (outside / "runs").mkdir(parents=True)
    out = subprocess.run(["make", "-s", "clean"], cwd=REPO, env={**env, "LLM_PIPELINE_VAR_DIR": str(outside)},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and (outside / "runs").is_dir(), out.stderr
    [line] = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("make: ***")]
    assert line.startswith(f"make clean: LLM_PIPELINE_VAR_DIR={outside} is outside this checkout"), line
    for code in ("tasks", ".git", "tasks/stages"):  # inside the checkout, but the code: kept
        out = subprocess.run(["make", "-s", "clean"], cwd=REPO, env={**env, "LLM_PIPELINE_VAR_DIR": code},
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode != 0 and (REPO / code).is_dir(), (code, out.stderr)
        assert f"make clean: LLM_PIPELINE_VAR_DIR={code} " in out.stderr, out.stderr
    inside = REPO / f"var-clean-test-{os.getpid()}"
    (inside / "runs").mkdir(parents=True)
    try:
        out = subprocess.run(["make", "-s", "clean"], cwd=REPO, env={**env, "LLM_PIPELINE_VAR_DIR": str(inside)},
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0 and not inside.exists(), out.stderr
    finally:
        shutil.rmtree(inside, ignore_errors=True)
