"""The metadata database's connect arguments for every Airflow process of this deployment (airflow.cfg's
[database] sql_alchemy_connect_args names CONNECT_ARGS; Airflow puts the plugins folder on sys.path before it
connects: airflow/settings.py, prepare_syspath_for_config_and_plugins, then configure_orm).

SQLite (the embedded default): a write that finds the database locked waits up to `timeout` seconds, then fails
with "database is locked". Python's sqlite3 waits 5 s by default, and `make ui` runs five processes that write the
one file (api-server, scheduler, dag-processor, triggerer, the task runners): on a busy 2-core host one of them
held it longer, and the trigger form's "unpause" (PATCH /api/v2/dags/llm_pipeline) failed with a 500 after
5.09 s — the run stayed queued on a paused DAG, with nothing on the page to say why. 60 s outlasts any write here;
it does not end the form's two requests locking each other: seen once, the unpause's audit-log insert
(airflow/api_fastapi/logging/decorators.py log_action, an async dependency that commits on the API server's event
loop) waited the whole 60 s for the lock and failed with a 500, and the trigger's POST, begun just before it,
finished only then. The fix is not a number: unpause before triggering (docs/operations.md).
Any other database (PostgreSQL for the Celery deployment) gets no extra arguments: `timeout` is not one of its
driver's.
"""

from __future__ import annotations

from airflow.configuration import conf

SQLITE_BUSY_TIMEOUT_S = 60.0


def connect_args(conn: str) -> dict:
    """The driver's connect arguments for the metadata database at `conn` (a SQLAlchemy URL)."""
    return {"timeout": SQLITE_BUSY_TIMEOUT_S} if conn.startswith("sqlite") else {}


CONNECT_ARGS = connect_args(conf.get("database", "sql_alchemy_conn"))
