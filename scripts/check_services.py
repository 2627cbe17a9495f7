"""Before an Airflow component starts: are its metadata DB, Celery broker and result backend reachable?

    python scripts/check_services.py [--mlflow-backend URI]   (exit 1: one line per unreachable service)

The URLs are Airflow's own effective configuration (airflow.cfg + AIRFLOW__* variables), so this checks exactly
what the scheduler and the workers will use; the broker and result backend only under the CeleryExecutor. Without
it a Celery worker retries a dead broker forever and a scheduler dies in a page-long traceback. Passwords are never
printed. docker/docker-compose.yml and the bare-metal recipe (docs/scale-out.md) run it before each component.
"""

from __future__ import annotations

import argparse
import sys

TIMEOUT_S = 5


def where(url: str) -> str:
    """The URL as shown to people, password removed, e.g. `postgresql+psycopg2://airflow@db:5432/airflow`."""
    from sqlalchemy.engine import URL, make_url

    try:
        u = make_url(url)
        shown = URL.create(u.drivername, u.username, None, u.host, u.port, u.database, u.query).render_as_string()
        return shown.replace("://@", "://")  # redis://:password@host: no user either
    except Exception:  # not an SQLAlchemy URL (redis://…): drop the userinfo's password by hand
        scheme, sep, rest = url.partition("://")
        userinfo, at, host = rest.rpartition("@")
        return f"{scheme}{sep}{userinfo.split(':')[0] + '@' if at else ''}{host}"


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_db(url: str) -> str | None:
    """None when a connection to the SQLAlchemy URL opens; else the reason in one line."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    url = url.removeprefix("db+")  # Celery's database result backend: db+<SQLAlchemy URL>
    args = {"connect_timeout": TIMEOUT_S} if url.startswith("postgresql") else {}
    try:  # a missing driver (postgresql:// is psycopg 3 in SQLAlchemy 2.1; we ship psycopg2) is a reason too
        engine = create_engine(url, connect_args=args, poolclass=NullPool)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as e:
        return _first_line(e)
    return None


def check_broker(url: str) -> str | None:
    """None when the broker answers (a Redis PING, or kombu's connect for other transports)."""
    if url.startswith(("redis://", "rediss://")):
        import redis

        try:
            redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S).ping()
        except Exception as e:
            return _first_line(e)
        return None
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=TIMEOUT_S) as conn:
            conn.ensure_connection(max_retries=1, timeout=TIMEOUT_S)
    except Exception as e:
        return _first_line(e)
    return None


def problems(executor: str, db_url: str, broker_url: str = "", result_backend: str = "", mlflow_backend: str = ""):
    """One line per unreachable service: which, where (no password), why, and the setting that names it."""
    checks = [("metadata DB", db_url, check_db, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")]
    if "Celery" in executor:
        checks += [
            ("Celery broker", broker_url, check_broker, "AIRFLOW__CELERY__BROKER_URL"),
            (  # a database backend (db+…) is a SQLAlchemy URL; a redis:// one is a broker-like server
                "Celery result backend",
                result_backend,
                check_db if result_backend.startswith("db+") else check_broker,
                "AIRFLOW__CELERY__RESULT_BACKEND",
            ),
        ]
    if mlflow_backend:
        checks.append(("MLflow backend store", mlflow_backend, check_db, "mlflow server --backend-store-uri"))
    out = []
    for what, url, check, setting in checks:
        if url.startswith("sqlite") and what == "metadata DB" and "Celery" not in executor:
            continue  # the embedded default: a file, created by `airflow db migrate`
        reason = check(url)
        if reason:
            out.append(f"{what} unreachable at {where(url)}: {reason} (start it, or fix {setting})")
    return out


def airflow_settings() -> dict:
    from airflow.configuration import conf

    db = conf.get("database", "sql_alchemy_conn")
    executor = conf.get("core", "executor")
    if "Celery" not in executor:
        return {"executor": executor, "db_url": db}
    return {
        "executor": executor,
        "db_url": db,
        "broker_url": conf.get("celery", "broker_url", fallback=""),
        "result_backend": conf.get("celery", "result_backend", fallback="") or f"db+{db}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mlflow-backend", default="", help="also check MLflow's backend store (a SQLAlchemy URI)")
    args = ap.parse_args(argv)
    lines = problems(**airflow_settings(), mlflow_backend=args.mlflow_backend)
    for line in lines:
        print(line, file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
