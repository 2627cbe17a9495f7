"""Before an Airflow component starts: are its metadata DB, Celery broker and result backend reachable?

    python scripts/check_services.py [--mlflow-backend URI]   (exit 1: one line per unreachable service)

The URLs are Airflow's own effective configuration (airflow.cfg + AIRFLOW__* variables), so this checks exactly
what the scheduler and the workers will use; the broker and result backend only under the CeleryExecutor. Without
it a Celery worker retries a dead broker forever and a scheduler dies in a page-long traceback. Passwords are never
printed. docker/docker-compose.yml and the bare-metal recipe (docs/scale-out.md) run it before each component.
"""

from __future__ import annotations

import argparse
import os
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
    from sqlalchemy.exc import ArgumentError
    from sqlalchemy.pool import NullPool

    url = url.removeprefix("db+")  # Celery's database result backend: db+<SQLAlchemy URL>
    args = {"connect_timeout": TIMEOUT_S} if url.startswith("postgresql") else {}
    try:  # a missing driver (postgresql:// is psycopg 3 in SQLAlchemy 2.1; we ship psycopg2) is a reason too
        engine = create_engine(url, connect_args=args, poolclass=NullPool)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except ModuleNotFoundError as e:  # the URL's dialect picks a DB-API driver that is not installed
        return missing_driver(url, e)
    except ArgumentError as e:  # not a URL at all: nothing to start ("start it" was the advice)
        return Unusable(f"{_first_line(e)}; write one such as postgresql+psycopg2://user@host:5432/db")
    except Exception as e:
        return _first_line(e)
    return None


class Unusable(str):
    """A reason that is no outage (nothing to start): the setting itself is wrong, and the reason says the fix."""


def missing_driver(url: str, e: ModuleNotFoundError) -> Unusable:
    """One line for a URL whose driver is not installed, naming the one to write: `postgresql://` means psycopg
    (3) to SQLAlchemy 2, and the image ships psycopg2 (`postgresql+psycopg2://`)."""
    import importlib.util

    scheme = url.removeprefix("db+").partition("://")[0]
    dialect = scheme.partition("+")[0]
    have = dialect == "postgresql" and importlib.util.find_spec("psycopg2") is not None
    fix = (
        "write postgresql+psycopg2:// (the driver installed here)"
        if have
        else f"install it, or name an installed driver in the URL ({dialect}+<driver>://)"
    )
    return Unusable(f"its driver {e.name!r} (for {scheme}://) is not installed; {fix}")


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
        if isinstance(reason, Unusable):
            out.append(f"{what} at {where(url)} cannot be used: {reason} (in {setting})")
        elif reason:
            out.append(f"{what} unreachable at {where(url)}: {reason} (start it, or fix {setting})")
    return out


def airflow_settings() -> dict:
    """Airflow's own reading of its configuration (airflow.cfg, AIRFLOW__* and their _CMD/_SECRET forms, defaults),
    without `import airflow`'s start-up: that builds the metadata DB's engine, so a URL whose driver is missing (a
    bare postgresql://) was a traceback before any check ran. `_AIRFLOW__AS_LIBRARY` is Airflow's own switch for
    that (airflow/__init__.py: settings.initialize() is skipped; the configuration is still read on import)."""
    os.environ["_AIRFLOW__AS_LIBRARY"] = "1"  # this process only: it runs no Airflow component
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
    try:
        settings = airflow_settings()
    except Exception as e:  # a broken airflow.cfg, an AIRFLOW__*_CMD that fails: one line, not Airflow's traceback
        print(f"cannot read Airflow's configuration: {type(e).__name__}: {_first_line(e)}", file=sys.stderr)
        return 1
    lines = problems(**settings, mlflow_backend=args.mlflow_backend)
    for line in lines:
        print(line, file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
