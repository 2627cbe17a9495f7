"""Shared test set-up: every test talks to real MLflow/Airflow, but in temporary stores, never the repo's var/."""

from __future__ import annotations

import gc
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The session's temporary files (torch elastic's torchelastic_* directories, torch.multiprocessing's error files of a
# failed rank, inductor's 155 MB precompiled header, g++'s and Airflow's temporaries, the Airflow stores below) in
# one directory of this session, inherited by the xdist workers and every process the tests start, and removed when
# the session ends (pytest_unconfigure): a run of the suite leaves nothing in the system's temporary directory but
# pytest's own basetemp, which stays where it was (PYTEST_DEBUG_TEMPROOT: the last sessions' failed tests' files).
SESSION_TMP = "LLM_PIPELINE_TEST_TMPDIR"
_OWN_SESSION_TMP = SESSION_TMP not in os.environ  # the controller (or a plain pytest), not an xdist worker
if _OWN_SESSION_TMP:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ[SESSION_TMP] = tempfile.mkdtemp(prefix="llm-pipeline-tests-")
    os.chmod(os.environ[SESSION_TMP], 0o711)  # passable, not listable: the Celery tests' postgres user reaches its own
os.environ["TMPDIR"] = os.environ[SESSION_TMP]
tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread in every test process and the processes it starts (stages, `airflow dags test`, a single torchrun
# rank; torchrun gives 2+ ranks one each already): two xdist workers share two cores, and a second thread in each only
# spins waiting for a core the other worker holds (a fixture of 1.6 CPU s on one thread measured 23 CPU s on two). Set
# before anything imports torch; a caller's own setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The cyclic collector as in every Airflow process of the deployment (importing the hook applies it to this process):
# full passes 10x rarer, none at exit. A test process comes to hold torch, transformers, Airflow and MLflow, whose
# objects all stay, and each full pass walks them all.
importlib.import_module("plugins.airflow_local_settings")
# Strict collectives (tasks/collectives.py): every collective of this session and of the torchrun workers it starts
# (they inherit the environment) is checked as HCCL would check it, on gloo. `=nccl` imitates NCCL, `=0` turns it off.
os.environ.setdefault("LLM_PIPELINE_STRICT_COLLECTIVES", "hccl")
# The embedded Airflow defaults (what scripts/airflow-env.sh exports), so `pytest` works without the Makefile too,
# except that the metadata DB, logs and passwords live in a temporary directory of this test session (set before
# anything imports airflow, and inherited by the `airflow` subprocesses the tests start).
AIRFLOW_TMP = Path(tempfile.mkdtemp(prefix="llm-pipeline-tests-airflow-"))
for key, value in {
    "AIRFLOW_HOME": str(REPO),
    "AIRFLOW_CONFIG": str(REPO / "airflow.cfg"),
    "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
}.items():
    os.environ.setdefault(key, value)
os.environ.update(
    {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{AIRFLOW_TMP / 'airflow.db'}",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(AIRFLOW_TMP / "logs"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(AIRFLOW_TMP / "passwords.json.generated"),
    }
)


def _migrate_airflow_db(tmp: Path) -> dict:
    db = tmp / "airflow.db"
    env = {**os.environ, "PYTHONPATH": str(REPO), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{db}"}
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {"db": str(db)}


@pytest.fixture(scope="session")
def airflow_db(tmp_path_factory) -> Path:
    """This process's Airflow metadata DB (what `airflow dags test` needs; each xdist worker has its own): a copy of
    the one `airflow db migrate` made for the session (~9 CPU s a migration)."""
    import shutil

    from tests.helpers.dags import once, session_root

    migrated = once(session_root(tmp_path_factory), "airflow-db", _migrate_airflow_db)["db"]
    shutil.copyfile(migrated, AIRFLOW_TMP / "airflow.db")
    return AIRFLOW_TMP / "airflow.db"


@pytest.fixture(scope="session")
def checkpoint_run(tmp_path_factory, airflow_db):
    """The session's one full `airflow dags test llm_pipeline` (ci-tiny from a tiny Qwen2 checkpoint with its own
    tokenizer, every stage), run once even under xdist (a file lock): read it, never write into it
    (tests/helpers/dags.py: tmp, out, ckpt, hf, fast)."""
    from tests.helpers.dags import shared_checkpoint_run

    return shared_checkpoint_run(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _session_root(tmp_path_factory) -> None:
    """Where the session's shared files live, for helpers called without fixtures (tests/helpers/mlflow_store.py)."""
    from tests.helpers.dags import session_root
    from tests.helpers.mlflow_store import ROOT_ENV

    os.environ[ROOT_ENV] = str(session_root(tmp_path_factory))


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """A real SQLite-backed MLflow store shared by the session's tests."""
    from tests.helpers.mlflow_store import fresh_store

    return fresh_store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


@pytest.fixture
def cfg(mlflow_uri, tmp_path):
    """The demo-cpu config with tracking in the test store and data under tmp_path."""
    from tasks.config import load_config

    c = load_config("demo-cpu")
    c.tracking.uri = mlflow_uri
    c.tracking.artifact_root = str(tmp_path / "mlartifacts")
    c.tracking.experiment = "tests"
    c.data.out_dir = str(tmp_path / "data")
    return c


@pytest.fixture
def fixtures_dir() -> Path:
    return REPO / "tests" / "fixtures"


# ---- the order files start in: the longest first -----------------------------------------------------------------
# Under make test's `--dist loadfile --no-loadscope-reorder` each xdist worker takes the next whole file in this order;
# starting the longest files first keeps one long file from running alone at the end (longest-processing-time-first).
# tests/durations.json holds each file's wall seconds (setup + call + teardown) from the last run that stored them
# (`make test PYTEST_ARGS=--store-durations`); a file not in it counts 30 s per slow test. tests/test_scale.py (the
# Qwen2-0.5B cut on 4 ranks) takes its place by duration too: it ran last for its memory, alone for its last ~50 s with
# one core idle through its one-process phases. Fresh clones the same half hour, last against in its place: the
# host's lowest MemAvailable 12.6 and 14.1 of 23.4 GB, idle CPU in the run's last 90 s 22 and 6 s, `.ci/run` 646 and
# 615 s (most of that the host's drift: the files that started first, beside the same files in both, 5-10 % cheaper).
DURATIONS = REPO / "tests" / "durations.json"


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    """Files run longest first (each file stays whole, its tests in order)."""
    stored = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    guess: dict[str, float] = {}
    for item in items:
        guess[_file(item.nodeid)] = guess.get(_file(item.nodeid), 0) + 30 * bool(item.get_closest_marker("slow"))

    def order(item):
        name = _file(item.nodeid)
        return -stored.get(name, guess[name])

    items.sort(key=order)  # stable


_file_s: dict[str, float] = {}  # this run's wall seconds per file (in xdist's controller: every worker's reports)


def pytest_runtest_logreport(report):
    _file_s[_file(report.nodeid)] = _file_s.get(_file(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    """--store-durations: this run's files' seconds into tests/durations.json (other files' entries kept)."""
    if not session.config.getoption("--store-durations") or hasattr(session.config, "workerinput"):
        return
    stored = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    stored.update({f: round(s, 1) for f, s in _file_s.items()})
    tmp = DURATIONS.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
    tmp.replace(DURATIONS)


# ---- unmarked slow tests fail (RULES: a test over 30 s on this host is marked slow) ---------------------------------
# Measured in CPU seconds, not wall time: this process's and its reaped children's (torchrun, `airflow dags test`, …;
# a child's own reaped children roll up into it), which a loaded host barely changes. Setup + call, in the process
# that runs the test: under xdist these hooks run in each worker, and the failed report travels to the controller.
# A module or session fixture's setup counts against the first test that needs it, as it does in that run.
SLOW_CPU_S = float(os.environ.get("LLM_PIPELINE_SLOW_TEST_CPU_S", "30"))  # 0 turns the check off
CPU_S = pytest.StashKey[float]()


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    start = _cpu_s()
    try:
        return (yield)
    finally:
        item.stash[CPU_S] = _cpu_s() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = _cpu_s()
    try:
        return (yield)
    finally:
        item.stash[CPU_S] = item.stash.get(CPU_S, 0.0) + _cpu_s() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cpu = item.stash.get(CPU_S, 0.0)
    if report.when == "call":
        report.user_properties.append(("cpu_s", cpu))  # travels to xdist's controller: --cpu-durations
    if report.when == "call" and report.passed and 0 < SLOW_CPU_S < cpu and not item.get_closest_marker("slow"):
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} took {cpu:.0f} s of CPU (over {SLOW_CPU_S:.0f} s): mark it @pytest.mark.slow"
    return report


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="list the N tests that used the most CPU (setup + call, children included), beside their wall time",
    )
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="write each file's wall seconds of this run into tests/durations.json (the order files start in)",
    )


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if not n:
        return
    rows: dict[str, list[float]] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call") and hasattr(r, "nodeid"):
                row = rows.setdefault(r.nodeid, [0.0, 0.0])
                row[1] += r.duration
                row[0] += dict(r.user_properties).get("cpu_s", 0.0)
    terminalreporter.write_sep("=", f"most CPU {n} (cpu s, wall s)")
    total = sum(c for c, _ in rows.values())
    for nodeid, (c, w) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{c:7.2f} {w:7.2f}  {nodeid}")
    terminalreporter.write_line(f"{total:7.1f} s of CPU in all {len(rows)} tests")


def pytest_unconfigure(config):
    """The session is over: this process (the controller, each xdist worker) exits without the interpreter's full
    collections over its objects (torch, transformers, Airflow, MLflow) during teardown — the reason of
    tasks.procs.skip_exit_collection; measured here ~1 CPU s a worker. The process that made the session's
    temporary directory (SESSION_TMP; after its xdist workers have ended) removes it."""
    gc.freeze()
    if _OWN_SESSION_TMP:
        import shutil

        shutil.rmtree(os.environ[SESSION_TMP], ignore_errors=True)
