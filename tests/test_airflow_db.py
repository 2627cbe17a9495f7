"""The metadata database's connect arguments (airflow.cfg → plugins/db_connect_args.py), seen by Airflow's own engine.

On a busy host, one of `make ui`'s processes held the SQLite file for over 5 s (sqlite3's default wait) and the
trigger form's unpause failed: the run stayed queued on a paused DAG (test_browser's CI failure of stop 54).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOLD_S = 6.5  # past sqlite3's default 5 s wait

CHILD = """
import sys, time
from airflow import settings
from db_connect_args import connect_args
assert connect_args("postgresql+psycopg2://u:p@127.0.0.1/airflow") == {}, "psycopg2 takes no `timeout`"
with settings.engine.connect() as c:
    print("busy_timeout", c.exec_driver_sql("PRAGMA busy_timeout").scalar(), flush=True)
    print("ready", flush=True)
    t0 = time.monotonic()
    c.exec_driver_sql("CREATE TABLE probe (x INTEGER)")  # a write: waits for the lock the test holds
    c.commit()
    print("waited", round(time.monotonic() - t0, 2), flush=True)
"""


def test_airflow_waits_for_a_sqlite_lock_held_past_sqlites_default_5_s(tmp_path):
    db = tmp_path / "airflow.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL")  # as Airflow's connections set it (airflow/utils/orm_event_handlers.py)
    holder.execute("CREATE TABLE held (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")  # the write lock, as a scheduler's long transaction holds it
    env = {**os.environ, "PYTHONPATH": str(REPO), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{db}"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = []
        for line in child.stdout:
            lines.append(line.split())
            if line.startswith("ready"):
                break
        assert lines and lines[-1] == ["ready"], child.communicate(timeout=60)[1][-2000:]
        time.sleep(HOLD_S)
        holder.execute("COMMIT")
        out, err = child.communicate(timeout=60)
    finally:
        holder.close()
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err[-2000:]
    assert ["busy_timeout", "60000"] in lines  # the engine's connections wait 60 s
    waited = float(out.split("waited", 1)[1])
    assert waited >= HOLD_S - 1.0, out  # it waited for the lock, and got it
