"""The operator's commands outside the stages (Makefile goals, scripts/): each bad input or interruption is one line
naming the cause and the fix, a non-zero exit, and nothing run or half-written behind it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.make import REPO
from tests.helpers.ports import free_port

MAKE_VARS = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS and k != "BENCH"}
    return {**env, **extra}


def _make(*args: str, timeout: int = 60, **env: str) -> subprocess.CompletedProcess:
    """`make -s ARGS` in its own process group, killed whole (SIGKILL: nothing it started writes on) past timeout:
    a regression here would start every bench."""
    proc = subprocess.Popen(["make", "-s", *args], cwd=REPO, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"make {' '.join(args)} was still running after {timeout} s (it ran its recipe)")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_goal_that_is_no_target_is_refused_before_any_goal_runs():
    """`make bench data` made `bench` first (every bench, tens of minutes, their figures replaced), then stopped at
    "No rule to make target 'data'". -n: a regression prints the recipe instead of running it."""
    out = _make("-n", "bench", "data")
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "make bench: 'data' is not a make target; name benches in BENCH: make bench BENCH=\"data\"" in line, line
    out = _make("help", "nosuch")  # help runs nothing harmful: without the check its lines were printed first
    assert out.returncode == 2 and not out.stdout, out.stdout
    [line] = out.stderr.strip().splitlines()
    assert "'nosuch' is not a make target (make help lists them); nothing was run" in line, line


def test_bench_names_reach_run_all_as_data(tmp_path):
    """BENCH names the benches; its text is split into words, never expanded by make or run by a shell."""
    marker = tmp_path / "pwned"
    out = _make("bench", f"BENCH=nosuch $(shell touch {marker}) `touch {marker}` $$(touch {marker}) *")
    assert not marker.exists(), "BENCH ran a command"
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("make: ***")]
    # run_all names the first unknown name it sorts first: any of the words, each as typed
    assert len(lines) == 1 and lines[0].startswith("run_all: no bench/bench_"), lines
    assert lines[0].split("bench/bench_")[1].split(".py;")[0] in ("nosuch", "$(shell", "`touch", "$$(touch", "*")


def test_make_db_refuses_a_relative_var_dir_before_writing(tmp_path):
    """A relative LLM_PIPELINE_VAR_DIR was Airflow's traceback (`Cannot use relative path: sqlite:///…`) and a stray
    directory in the checkout."""
    rel = f"ops-audit-relative-var-{os.getpid()}"
    try:
        out = subprocess.run(["bash", "scripts/migrate-db.sh"], cwd=REPO, env=_env(LLM_PIPELINE_VAR_DIR=rel),
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 2, out.stdout + out.stderr
        assert (out.stdout + out.stderr).strip().splitlines() == [
            f"error: LLM_PIPELINE_VAR_DIR={rel} is a relative path (each process would read it from its own working "
            f"directory); give an absolute one, e.g. LLM_PIPELINE_VAR_DIR=$PWD/{rel}"
        ]
        assert not (REPO / rel).exists()
    finally:
        shutil.rmtree(REPO / rel, ignore_errors=True)


FAKE_AIRFLOW = """#!{python}
# `airflow dags test` as run-pipeline.sh sees it: a task starts, Ctrl-C fails it, Airflow says so and exits 1.
import os, signal, sys, time
from pathlib import Path
run = Path(os.environ["FAKE_RUN_DIR"]); run.mkdir(parents=True, exist_ok=True)
Path(os.environ["LLM_PIPELINE_RUN_DIR_FILE"]).write_text(str(run))
def interrupted(*_):
    time.sleep(0.5)  # Airflow fails the task, then writes: the log's tee must still be reading
    print("AIRFLOW AFTER CTRL-C: task smoke failed", flush=True)
    sys.exit(1)
signal.signal(signal.SIGINT, interrupted)
print("x [DAG TEST] starting task_id=smoke map_index=-1 [airflow.sdk.definitions.dag]", flush=True)
Path(os.environ["FAKE_READY"]).touch()
time.sleep(120)
sys.exit(3)
"""


def _fake_checkout(tmp_path, airflow: str) -> tuple[Path, dict]:
    """A checkout of links to this one with `airflow` replaced by the script `airflow`, and run-pipeline.sh's env."""
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("scripts", "tasks", "data_prep", "configs", "dags", "plugins"):
        (root / name).symlink_to(REPO / name)
    fake = root / ".venv" / "bin" / "airflow"
    fake.parent.mkdir(parents=True)
    fake.write_text(airflow.format(python=sys.executable))
    fake.chmod(0o755)
    env = _env(
        LLM_PIPELINE_VAR_DIR=str(tmp_path / "var"),
        LLM_PIPELINE_CONF='{"preset": "ci-tiny"}',
        LLM_RUN_LOG=str(tmp_path / "make-run.log"),
        FAKE_RUN_DIR=str(tmp_path / "run"),
        FAKE_READY=str(tmp_path / "ready"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    for k in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__LOGGING__BASE_LOG_FOLDER", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    return root, env


FAKE_AIRFLOW_REFUSED = """#!{python}
# `airflow dags test` whose first task refuses the run's Params: no run directory, one ERROR line, exit 1.
print("ConfigError: train.steps: -1 must be in [0, 1000000000]", flush=True)
raise SystemExit(1)
"""


def test_a_run_no_stage_of_which_ran_says_why_on_stderr(tmp_path):
    """`error: no stage ran: <cause>` went to stdout, beside the screen's progress, where every other error line of
    make run goes to stderr (a wrapper reading stderr saw nothing)."""
    root, env = _fake_checkout(tmp_path, FAKE_AIRFLOW_REFUSED)
    out = subprocess.run(["bash", str(root / "scripts" / "run-pipeline.sh")], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    want = "error: no stage ran: ConfigError: train.steps: -1 must be in [0, 1000000000]"
    assert out.stderr.strip().splitlines()[-1] == want and want not in out.stdout, (out.stdout, out.stderr)


def test_ctrl_c_of_make_run_keeps_the_log_says_so_and_exits_130(tmp_path):
    """Ctrl-C (SIGINT to the foreground group) killed the log's tee and the screen filter (a KeyboardInterrupt
    traceback on screen): the log stopped at the Ctrl-C, Airflow's own closing lines went nowhere (its DAG run was
    left `running`), and make run ended in exit 1 without saying it was interrupted. The real script, a checkout of
    links and an `airflow` that behaves as `dags test` does on SIGINT."""
    root, env = _fake_checkout(tmp_path, FAKE_AIRFLOW)
    var, ready, log = tmp_path / "var", tmp_path / "ready", tmp_path / "make-run.log"
    proc = subprocess.Popen(["bash", str(root / "scripts" / "run-pipeline.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate(timeout=30)
        # Ctrl-C once the log's tee and the screen filter are up (each sets its `trap '' INT` first: a user's Ctrl-C
        # comes seconds later; on a loaded host the test's could come between a subshell's fork and its trap): the
        # filter has shown the task, and the tee has written its line to the log.
        seen = []
        while not any("… smoke" in line for line in seen) and time.monotonic() < deadline:
            seen.append(proc.stdout.readline())
            if not seen[-1]:
                break
        while "starting task_id=smoke" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends the foreground group on Ctrl-C
        out, err = proc.communicate(timeout=60)
        out = "".join(seen) + out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "AIRFLOW AFTER CTRL-C: task smoke failed" in log.read_text(), "the log stopped at the Ctrl-C"
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert "  … smoke" in out
    assert proc.returncode == 130, out + err
    lines = err.strip().splitlines()
    assert lines[-1] == (
        f"error: make run was interrupted (Ctrl-C): the tasks still to run did not run; the full log is {log}; "
        "`make run` again starts a new run"
    ), lines
    assert not list((var / "logs").glob(".make-run-*.rundir"))  # this invocation's hand-off file is gone


def test_make_ui_names_the_variable_of_the_busy_port(tmp_path):
    """A port in use was `port N … (set AIRFLOW_PORT / MLFLOW_PORT)`: which one, the user had to work out."""
    ml_port = free_port()
    env = {k: v for k, v in _env().items() if not k.startswith(("AIRFLOW", "MLFLOW", "LLM_PIPELINE", "UI_", "STOP_"))}
    env.update(LLM_PIPELINE_VAR_DIR=str(tmp_path / "var"), AIRFLOW_PORT=str(free_port()), MLFLOW_PORT=str(ml_port))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ml_port))
        busy.listen()
        try:
            out = subprocess.run(["bash", str(REPO / "scripts" / "ui.sh")], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
        finally:  # a ui.sh that got past the check started servers: stop them
            if (tmp_path / "var" / "airflow.pid").exists() or (tmp_path / "var" / "mlflow.pid").exists():
                subprocess.run(["bash", str(REPO / "scripts" / "stop.sh")], env={**env, "STOP_WAIT_S": "10"},
                               capture_output=True, timeout=120)  # fmt: skip
    assert out.returncode == 1 and not out.stdout, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        f"ui: MLFLOW_PORT={ml_port}: 127.0.0.1:{ml_port} is already in use by another program (or a make ui of another "
        "LLM_PIPELINE_VAR_DIR): stop it, or set MLFLOW_PORT to a free port"
    ]
    assert not (tmp_path / "var" / "mlflow.pid").exists()


def _npu_api():
    spec = importlib.util.spec_from_file_location("npu_api_ops_audit", REPO / "scripts" / "npu_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_npu_api_refuses_an_amct_dir_it_cannot_read_before_refreshing_anything(tmp_path, monkeypatch, capsys):
    """`make npu-api AMCT_GIT_DIR=…` on a path that is no git directory, or one without AMCT's branches, was
    CalledProcessError's traceback, after the torch_npu snapshots had been rewritten."""
    npu_api = _npu_api()
    downloads = []
    monkeypatch.setattr(npu_api, "torch_npu_pins", lambda: downloads.append(1) or [])  # none downloaded here
    assert npu_api.main(["--amct-git", str(tmp_path / "nope")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"npu-api: --amct-git / AMCT_GIT_DIR {tmp_path / 'nope'} is not a git directory"), line
    assert "unset AMCT_GIT_DIR" in line and not downloads
    bare = tmp_path / "amct.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    assert npu_api.main(["--amct-git", str(bare)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{bare} has no '8.5.0'" in line and f"git --git-dir {bare} fetch origin 8.5.0:8.5.0" in line, line
    assert not downloads


def _check_services():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import check_services
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return check_services


def test_check_services_does_not_say_start_it_for_a_url_that_is_no_url():
    check_services = _check_services()
    [line] = check_services.problems("LocalExecutor", "notaurl")
    assert line.startswith("metadata DB at notaurl cannot be used: Could not parse SQLAlchemy URL"), line
    assert "write one such as postgresql+psycopg2://" in line and "start it" not in line


def test_check_services_shows_no_part_of_a_password_and_refuses_only_what_its_parser_misreads():
    """where() split the userinfo at a Redis URL's first '@' (SQLAlchemy's parse: `redis://tPW@127.0.0.1`), and an
    exception's text was printed as it came (a driver may echo the URL). Shown: the user name, then the host after
    the LAST '@'; an '@' that is not the userinfo's end hides more, never a password."""
    cs = _check_services()
    shown = {
        "postgresql+psycopg2://airflow:p@ss:w0rd@db:5432/airflow": "postgresql+psycopg2://airflow@db:5432/airflow",
        "redis://:s3cr@tPW@db:6379/0": "redis://db:6379/0",
        "redis://:a/b?c#d@db:6379/0": "redis://db:6379/0",
        "db+postgresql+psycopg2://airflow:x%40y@db/airflow": "db+postgresql+psycopg2://airflow@db/airflow",
        "redis://:p1@h1:6379/0;redis://:p2@h2:6379/0": "redis://h1:6379/0;redis://h2:6379/0",  # kombu's failover
        "user:pw@db/airflow": "***@db/airflow",  # no scheme: still no userinfo
        "postgresql+psycopg2://airflow@/airflow?host=/run/pg": "postgresql+psycopg2://airflow@/airflow?host=/run/pg",
        "postgresql+psycopg2://u:pw@db/a?sslrootcert=/x@y.pem": "postgresql+psycopg2://u@y.pem",  # hides more
        "sqlite:////srv/u@x/airflow.db": "sqlite:////srv/u@x/airflow.db",
        "postgresql+psycopg2://airflow@db/airflow?password=Vq8z&sslmode=require": (  # libpq's keyword
            "postgresql+psycopg2://airflow@db/airflow?password=***&sslmode=require"
        ),
    }
    for url, expected in shown.items():
        assert cs.where(url) == expected, url
    # a driver's text that echoes the URL: the password, as typed or decoded, is replaced
    url = "redis://:Hq3v%40Lp8@db:6379/0"
    line = cs._first_line(ValueError(f"cannot connect to {url} (password Hq3v@Lp8)\nsecond line"), url)
    assert line == "cannot connect to redis://:***@db:6379/0 (password ***)", line
    url = "postgresql+psycopg2://airflow@db/airflow?password=Vq8z"
    assert cs._first_line(ValueError("password Vq8z refused"), url) == "password *** refused"
    # refused (one line, with the fix) only where the consumer's own parser misreads the userinfo
    sa, kombu = cs._sqlalchemy_parts, cs._kombu_parts
    misread = [
        ("postgresql+psycopg2://airflow:p@ss:w0rd@db:5432/airflow", sa),  # port 'w0rd@db:5432': no number
        ("postgresql+psycopg2://airflow:p@ss@db:5432/airflow", sa),  # host 'ss@db'
        ("redis://:ab/cd@db:6379/0", kombu),  # netloc ':ab': port 'ab'
        ("redis://:12/34@db:6379/0", kombu),  # port 12, db '34@db:6379/0'
        ("redis://:a;b@db:6379/0", kombu),  # kombu's failover split
        ("redis://:a#b@db:6379/0", kombu),
        ("postgresql+psycopg2://airflow:p@ss:x9q@db:abc/airflow", sa),  # a bad port too: 'x9q@db:abc' was shown
    ]
    for url, parse in misread:
        reason = cs.unreadable(url, parse)
        assert isinstance(reason, cs.Unusable) and "urllib.parse.quote(password, safe='')" in reason, url
    read_as_meant = [
        ("redis://:s3cr@tPW@db:6379/0", kombu),  # kombu and redis-py take the host after the last '@'
        ("redis://:a:b@db:6379/0", kombu),
        ("amqp://guest:gu@st@db:5672//", kombu),
        ("postgresql+psycopg2://airflow:a/b:c?d@db:5432/airflow", sa),  # SQLAlchemy: the password ends at '@'
        ("postgresql+psycopg2://airflow:p%40ss@db:5432/airflow", sa),
        ("postgresql+psycopg2://u:pw@db/a?sslrootcert=/x@y.pem", sa),  # an '@' in the query
        ("sqlite:////srv/u@x/airflow.db", sa),  # a path, no userinfo
        ("postgresql+psycopg2://airflow:pw@db:5432/airflow", sa),
    ]
    for url, parse in read_as_meant:
        assert cs.unreadable(url, parse) is None, url


def test_make_clean_refuses_a_var_dir_that_make_ui_or_make_run_is_using():
    """`make clean` under a running `make ui` deleted its pid files with the rest: the servers ran on, orphaned
    (`make stop`: "not running"), holding the ports the next `make ui` needs; under a `make run`, its run directory."""
    inside = REPO / f"var-ops-audit-clean-{os.getpid()}"
    (inside / "logs").mkdir(parents=True)
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (inside / "mlflow.pid").write_text(f"{server.pid}\n")
        out = _make("clean", LLM_PIPELINE_VAR_DIR=str(inside))
        assert out.returncode != 0 and (inside / "mlflow.pid").is_file(), out.stderr
        [line] = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("make: ***")]
        assert line == (
            f"make clean: make ui's mlflow (pid {server.pid}) is running from {inside}; "
            "run make stop first, then make clean"
        )
        server.kill()
        server.wait()
        (inside / "logs" / ".make-run.holder").write_text("pid 1, log x\n")
        with open(inside / "logs" / ".make-run.lock", "a") as lock:  # what run-pipeline.sh holds while it runs
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out = _make("clean", LLM_PIPELINE_VAR_DIR=str(inside))
        assert out.returncode != 0 and inside.is_dir(), out.stderr
        assert f"make clean: a make run is running from {inside} (pid 1, log x); wait for it" in out.stderr
        out = _make("clean", LLM_PIPELINE_VAR_DIR=str(inside))  # nothing running from it now (a stale pid file)
        assert out.returncode == 0 and not inside.exists(), out.stderr
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(inside, ignore_errors=True)


def test_make_ui_on_a_var_dir_that_takes_no_write_is_one_line(tmp_path):
    """Was mkdir's own line(s) (`cannot create directory … Not a directory`), with no fix, from two places."""
    (tmp_path / "afile").write_text("")
    var = tmp_path / "afile" / "var"  # a var dir under a file: no write can succeed, even as root
    env = {k: v for k, v in _env().items() if not k.startswith(("AIRFLOW", "MLFLOW", "LLM_PIPELINE", "UI_", "STOP_"))}
    env.update(LLM_PIPELINE_VAR_DIR=str(var), AIRFLOW_PORT=str(free_port()), MLFLOW_PORT=str(free_port()))
    out = subprocess.run(["bash", str(REPO / "scripts" / "ui.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        f"ui: {var} is not writable (Not a directory): fix its permissions, or set LLM_PIPELINE_VAR_DIR to a "
        "writable directory"
    ]
