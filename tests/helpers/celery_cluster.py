"""A real scale-out cluster on this host for tests and bench/bench_fanout.py: PostgreSQL and Redis from the Debian
packages (scripts/install-services.sh), Airflow's api-server, scheduler and dag-processor on the CeleryExecutor,
N Celery workers, and an MLflow server whose backend store is PostgreSQL and which serves the artifacts.

Everything lives under one temporary directory and listens on free loopback ports. PostgreSQL refuses to run as
root: as root, its data directory belongs to the `postgres` user (created by the Debian package) and initdb/postgres
run as that user. Each worker is its own process group (killed with the whole group, as a crashed host would be)
and names itself through `worker_hostname` (hostname_callable), so task instances say which worker ran them.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from tests.helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER_ENV = "LLM_CELERY_WORKER"  # each worker's name, read by worker_hostname()


def worker_hostname() -> str:
    """[core] hostname_callable of the cluster: the worker's name (several workers share this host)."""
    return os.environ.get(WORKER_ENV) or socket.getfqdn()


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} not found: run scripts/install-services.sh (make test does)")
    return found[-1]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def wait_for(check, timeout_s: float, what: str, log: Path | None = None, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{what} not ready within {timeout_s:.0f} s:\n{tail}")


class Cluster:
    def __init__(self, root: Path | None = None, dags: list[Path] = (), extra_env: dict | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="llm-celery-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.workers: list[str] = []  # the Celery workers' names (keys of procs)
        self.ports = {k: free_port() for k in ("pg", "redis", "api", "mlflow")}
        self.dags_dir = self.root / "dags"
        self.dags_dir.mkdir(exist_ok=True)
        for path in dags:
            (self.dags_dir / Path(path).name).symlink_to(Path(path).resolve())
        db = f"postgresql+psycopg2://airflow@127.0.0.1:{self.ports['pg']}"
        self.db_url, self.mlflow_db_url = f"{db}/airflow", f"{db}/mlflow"
        self.broker_url = f"redis://127.0.0.1:{self.ports['redis']}/0"
        self.api_url = f"http://127.0.0.1:{self.ports['api']}"
        self.mlflow_url = f"http://127.0.0.1:{self.ports['mlflow']}"
        self.artifacts = self.root / "mlartifacts"
        self.var = self.root / "var"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "AIRFLOW_HOME": str(REPO),
            "AIRFLOW_CONFIG": str(REPO / "airflow.cfg"),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.db_url,
            "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{self.db_url}",
            # solo: the task runs under the worker's main process. A prefork pool child is daemonic, and a stage
            # that starts processes (shard's tokenizer pool) fails there: "daemonic processes are not allowed to
            # have children". Parallelism comes from more workers.
            "AIRFLOW__CELERY__POOL": "solo",
            # as deployed (docker/docker-compose.yml): a solo worker reserves only the task it runs (Airflow's
            # default concurrency 16 let one worker hold 16 ready tasks while the other sat idle)
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_dir),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "4",
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.helpers.celery_cluster.worker_hostname",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.ports["api"]),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.root / "logs"),
            # The DAG files are in place before the dag-processor starts and never change: parsed once (and for
            # each DAG callback, queued at once whatever the interval), not every 5 s (seconds of CPU per parse).
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "3600",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",  # only the runs a test triggers (no cron/asset runs)
            # A killed worker's task stops heartbeating: failed (and retried) after this many seconds.
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            "LLM_PIPELINE_VAR_DIR": str(self.var),
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            **(extra_env or {}),
        }
        self.env.pop(WORKER_ENV, None)

    # -- processes -------------------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], env: dict | None = None, user: str | None = None):
        log = open(self.root / f"{name}.log", "ab")
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or self.env,
            cwd=self.root,
            start_new_session=True,
            user=user,
        )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def start_postgres(self) -> None:
        # Its own directory in the session's temporary directory (tests/conftest.py, 0711), not pytest's tmp (0700):
        # as root, the postgres user must reach it.
        self.pg_root = Path(tempfile.mkdtemp(prefix="llm-pg-"))
        pgdata = self.pg_root / "data"
        user = "postgres" if os.geteuid() == 0 else None
        pgdata.mkdir()
        if user:
            shutil.chown(self.pg_root, user)
            shutil.chown(pgdata, user)
        initdb = [pg_bin("initdb"), "-D", str(pgdata), "-U", "airflow", "--auth=trust", "-E", "UTF8", "--no-sync"]
        out = subprocess.run(initdb, capture_output=True, text=True, user=user, timeout=120)
        if out.returncode:
            raise RuntimeError(f"initdb failed: {out.stderr[-2000:]}")
        port = str(self.ports["pg"])
        opts = ["-c", "listen_addresses=127.0.0.1", "-p", port, "-k", str(pgdata), "-c", "fsync=off"]
        opts += ["-c", "full_page_writes=off", "-c", "max_connections=200", "-c", "shared_buffers=64MB"]
        # a throwaway cluster (fsync is off already): no commit waits for its WAL record to be written
        opts += ["-c", "synchronous_commit=off"]
        proc = self._spawn("postgres", [pg_bin("postgres"), "-D", str(pgdata), *opts], user=user)
        wait_for(
            lambda: (
                subprocess.run([pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", port], capture_output=True).returncode
                == 0
            ),
            60,
            "postgres",
            self.log("postgres"),
            proc,
        )
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.ports["pg"], user="airflow", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            for name in ("airflow", "mlflow"):
                cur.execute(f"CREATE DATABASE {name}")
        conn.close()

    def start_redis(self) -> None:
        port = str(self.ports["redis"])
        cmd = ["redis-server", "--port", port, "--bind", "127.0.0.1", "--dir", str(self.root), "--save", ""]
        proc = self._spawn("redis", cmd + ["--appendonly", "no"])
        wait_for(lambda: self.redis().ping(), 30, "redis", self.log("redis"), proc)

    def redis(self):
        import redis

        return redis.Redis.from_url(self.broker_url, socket_timeout=5)

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start_airflow(self) -> None:
        """Migrate the metadata DB, then the api-server, scheduler and dag-processor (not waited for)."""
        out = self.airflow("db", "migrate")
        if out.returncode:
            raise RuntimeError(f"airflow db migrate failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
        for name in ("api-server", "scheduler", "dag-processor"):
            self._spawn(name, [sys.executable, "-m", "airflow", name])

    def wait_api(self, timeout_s: float = 300) -> None:
        wait_for(
            lambda: self.get("/api/v2/monitor/health")["metadatabase"]["status"] == "healthy",
            timeout_s,
            "api-server",
            self.log("api-server"),
            self.procs["api-server"],
        )

    def start_worker(self, name: str, queues: str = "default", wait: bool = True) -> subprocess.Popen:
        """`airflow celery worker` (solo pool: one task at a time), named `name` (hostname_callable), on `queues`."""
        env = {**self.env, WORKER_ENV: name}
        cmd = [sys.executable, "-m", "airflow", "celery", "worker", "--queues", queues]
        cmd += ["--celery-hostname", f"{name}@%h", "--skip-serve-logs"]
        self.log(name).unlink(missing_ok=True)
        proc = self._spawn(name, cmd, env=env)
        self.workers.append(name)
        if wait:
            self.wait_worker(name)
        return proc

    def wait_worker(self, name: str, timeout_s: float = 300) -> None:
        log = self.log(name)
        wait_for(lambda: b" ready." in log.read_bytes(), timeout_s, f"celery worker {name}", log, self.procs[name])

    def kill_worker(self, name: str) -> None:
        """SIGKILL the worker as a lost host would lose it: its process group (the worker, which supervises its
        task) and the task runner with everything under it (Airflow puts each task runner in its own group)."""
        import psutil

        proc = self.procs.pop(name)
        self.workers.remove(name)
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)  # before the kill: orphans leave the tree
        except psutil.NoSuchProcess:
            tree = []
        for pgid in {proc.pid, *(_pgid(p.pid) for p in tree)} - {None}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        psutil.wait_procs(tree, timeout=30)

    def stopped_task(self) -> str | None:
        """The worker one of whose processes is stopped (SIGSTOP: DATA_PREP_FAULT="<step>:<index>:stop"), or None."""
        import psutil

        for name in self.workers:
            try:
                if any(
                    p.status() == psutil.STATUS_STOPPED
                    for p in psutil.Process(self.procs[name].pid).children(recursive=True)
                ):
                    return name
            except psutil.NoSuchProcess:
                continue
        return None

    def start_mlflow(self) -> None:
        self.artifacts.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.ports["mlflow"])]
        cmd += ["--workers", "1", "--backend-store-uri", self.mlflow_db_url]
        cmd += ["--artifacts-destination", str(self.artifacts), "--serve-artifacts"]
        # without its GenAI job runner and 7 Huey consumers, as scripts/ui.sh starts it (unused here: ~2 GB)
        self._spawn("mlflow", cmd, env={**self.env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})

    def wait_mlflow(self, timeout_s: float = 300) -> None:
        wait_for(
            lambda: urllib.request.urlopen(f"{self.mlflow_url}/health", timeout=5).status == 200,
            timeout_s,
            "mlflow server",
            self.log("mlflow"),
            self.procs["mlflow"],
        )

    def start(self, workers: dict[str, str] | None = None, mlflow: bool = True) -> Cluster:
        """PostgreSQL + Redis, then MLflow, Airflow and the workers {name: queues} side by side (MLflow migrates
        its schema while Airflow migrates its own), then wait until every one is ready."""
        self.start_postgres()
        self.start_redis()
        if mlflow:
            self.start_mlflow()
        self.start_airflow()
        workers = workers or {"w1": "default", "w2": "default"}
        for name, queues in workers.items():
            self.start_worker(name, queues, wait=False)
        self.wait_api()
        if mlflow:
            self.wait_mlflow()
        for name in workers:
            self.wait_worker(name)
        return self

    def stop(self) -> None:
        """SIGKILL every process group but PostgreSQL's (a test cluster keeps nothing: a graceful shutdown of the
        api-server alone takes 10 s under load) and every task runner (each is its own group); SIGINT to postgres,
        its fast shutdown. The PostgreSQL directory goes whatever happened."""
        import psutil

        tree = []  # postgres's own children follow their postmaster
        for name, proc in self.procs.items():
            try:
                tree += [] if name == "postgres" else psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        try:
            for name, proc in self.procs.items():
                try:
                    os.killpg(proc.pid, signal.SIGINT if name == "postgres" else signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            for name, proc in self.procs.items():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
            psutil.wait_procs(tree, timeout=30)
            self.procs.clear()
            self.workers.clear()
        finally:
            if getattr(self, "pg_root", None):
                shutil.rmtree(self.pg_root, ignore_errors=True)

    # -- REST ------------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.api_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")

    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def wait_for_dag(self, dag_id: str, timeout_s: float = 180) -> None:
        """Until the dag-processor has parsed it; then unpause it."""
        wait_for(lambda: self.get(f"/api/v2/dags/{dag_id}")["dag_id"] == dag_id, timeout_s, f"DAG {dag_id}")
        self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        self.wait_for_dag(dag_id)
        run = self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def wait_run(self, dag_id: str, run_id: str, timeout_s: float) -> str:
        """The run's final state (success/failed), or RuntimeError with the task states after `timeout_s`."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                state = self.get(path)["state"]
            except OSError:  # an api-server slow under load (URLError and timeouts are OSErrors): ask again
                state = None
            if state in ("success", "failed"):
                return state
            time.sleep(2)
        states = {(t["task_id"], t["map_index"]): t["state"] for t in self.task_instances(dag_id, run_id)}
        raise RuntimeError(f"{dag_id} {run_id} not finished within {timeout_s:.0f} s: {states}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances?limit=1000"
        return self.get(path)["task_instances"]

    def tries(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> list[dict]:
        run = urllib.parse.quote(run_id, safe="")
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}/{map_index}/tries"
        return self.get(path)["task_instances"]
