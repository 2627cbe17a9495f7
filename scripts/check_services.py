"""Before an Airflow component starts: are its metadata DB, Celery broker and result backend reachable?

    python scripts/check_services.py [--mlflow-backend URI]   (exit 1: one line per unreachable service)

The URLs are Airflow's own effective configuration (airflow.cfg + AIRFLOW__* variables), so this checks exactly
what the scheduler and the workers will use; the broker and result backend only under the CeleryExecutor. Without
it a Celery worker retries a dead broker forever and a scheduler dies in a page-long traceback. No part of a password
is printed: a URL shows its user name and what follows the userinfo's last '@', a driver's error has the password
replaced, and a URL whose own parser would misread an unescaped '@', ':', '/', '?', '#' or ';' in the password (and
then echo its pieces) is named as such, with the fix (percent-encode it), never connected to. docker/docker-compose.yml
and the bare-metal recipe (docs/scale-out.md) run it before each component.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from urllib.parse import quote, unquote

TIMEOUT_S = 5


class Unusable(str):
    """A reason that is no outage (nothing to start): the setting itself is wrong, and the reason says the fix."""


def _pieces(url: str) -> list[str]:
    """A broker URL may be a failover list (`redis://a;redis://b`, kombu); anything else is one URL."""
    pieces = url.split(";")
    return pieces if len(pieces) > 1 and all("://" in p for p in pieces) else [url]


def _split(url: str) -> tuple[str, str | None, str]:
    """(`scheme://`, the userinfo or None, what follows it). The userinfo ends at the URL's LAST '@': a host never
    holds one, a password may (typed unescaped). An '@' in the path or query is taken for the userinfo's end too,
    which hides more than the password, never less."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url  # no scheme: still no userinfo shown
    userinfo, at, after = rest.rpartition("@")
    return scheme + sep, (userinfo if at else None), (after if at else rest)


# a password given as a query parameter (`?password=…`: libpq's keyword, redis-py's keyword argument)
PW_PARAM = re.compile(r"([?&](?:password|passwd|pwd)=)([^&#]*)", re.I)


def _secrets(url: str) -> list[str]:
    """The password(s) of the URL as typed, decoded and re-encoded: what an exception's text must not show."""
    out = set()
    for piece in _pieces(url):
        _, userinfo, _ = _split(piece)
        found = [m.group(2) for m in PW_PARAM.finditer(piece)]
        if userinfo is not None and ":" in userinfo:
            found.append(userinfo.partition(":")[2])
        for pw in found:
            out.update(v for v in (pw, unquote(pw), quote(unquote(pw), safe="")) if v)
    return sorted(out, key=len, reverse=True)


def where(url: str) -> str:
    """The URL as shown to people, password removed, e.g. `postgresql+psycopg2://airflow@db:5432/airflow`: the user
    name (up to the userinfo's first ':') is kept, nothing between it and the host."""
    shown = []
    for piece in _pieces(url):
        head, userinfo, rest = _split(piece)
        if userinfo is None:
            shown.append(piece)
        elif not head:
            shown.append(f"***@{rest}")
        else:
            user = userinfo.partition(":")[0]
            shown.append(f"{head}{user + '@' if user else ''}{rest}")
    return PW_PARAM.sub(r"\1***", ";".join(shown))


def _scrub(text: str, url: str) -> str:
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def _first_line(e: BaseException, url: str = "") -> str:
    """The exception's first line, any password of `url` in it replaced by `***` (a driver may echo the URL)."""
    text = _scrub(str(getattr(e, "orig", None) or e).strip(), url)
    return text.splitlines()[0] if text else type(e).__name__


def _sqlalchemy_parts(url: str) -> list[tuple]:
    from sqlalchemy.engine import make_url

    u = make_url(url.removeprefix("db+"))
    return [(u.username, u.password, u.host, u.port, u.database)]


def _kombu_parts(url: str) -> list[tuple]:
    from kombu.utils.url import url_to_parts

    parts = [url_to_parts(p) for p in url.split(";")]  # kombu's Connection splits at every ';' (failover URLs)
    return [(p.username, p.password, p.hostname, p.port, p.path) for p in parts]


def _try(parse, url: str) -> list[tuple] | None:
    try:
        return parse(url)
    except Exception:  # a port that is no number, an IPv6 bracket left open, …
        return None


def unreadable(url: str, parse) -> Unusable | None:
    """A reason when `parse` (the consumer's own URL parser: SQLAlchemy's, or kombu's, which redis-py shares less
    the ';' split) cannot read the URL's userinfo up to its last '@': it fails on the URL but not on the same URL
    with the userinfo percent-encoded, or it reads a host or database holding an '@' (the rest of a password), or
    kombu splits the password at a ';', or it fails on both and the userinfo holds one of those characters. Then
    its error would show pieces of the password. None when the parser reads the URL as meant, e.g. an '@' or ':' in
    a Redis password (kombu takes the host after the last '@')."""
    for piece in _pieces(url):
        head, userinfo, rest = _split(piece)
        if not head or userinfo is None or head.startswith(("sqlite", "unix", "file")):
            continue  # no userinfo, or a scheme whose URL is a file path (which may hold an '@')
        user, colon, pw = userinfo.partition(":")
        encoded = f"{head}{quote(unquote(user), safe='')}{colon}{quote(unquote(pw), safe='')}@{rest}"
        if encoded == piece:
            continue
        read, meant = _try(parse, piece), _try(parse, encoded)
        if read is not None and read == meant:
            continue  # read as meant
        if meant is None:  # wrong elsewhere too (a port that is no number): its error may hold the password's
            misread = read is None and any(c in "@:/?#;" for c in user + pw)  # pieces, so that fix comes first
        else:
            misread = read is None or len(read) != len(meant)
            misread = misread or any("@" in str(p[2] or "") + str(p[4] or "") for p in read)
        if misread:
            return Unusable(
                "its user name or password cannot be told apart from the host: an '@', ':', '/', '?', '#' or ';' "
                "in it must be percent-encoded (urllib.parse.quote(password, safe='')), or choose one of letters, "
                "digits and -._~"
            )
    return None


def check_db(url: str) -> str | None:
    """None when a connection to the SQLAlchemy URL opens; else the reason in one line."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import ArgumentError
    from sqlalchemy.pool import NullPool

    url = url.removeprefix("db+")  # Celery's database result backend: db+<SQLAlchemy URL>
    bad = unreadable(url, _sqlalchemy_parts)
    if bad:  # connecting would misread it: another host, or the password's pieces echoed in the driver's error
        return bad
    args = {"connect_timeout": TIMEOUT_S} if url.startswith("postgresql") else {}
    try:  # a missing driver (postgresql:// is psycopg 3 in SQLAlchemy 2.1; we ship psycopg2) is a reason too
        engine = create_engine(url, connect_args=args, poolclass=NullPool)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except ModuleNotFoundError as e:  # the URL's dialect picks a DB-API driver that is not installed
        return missing_driver(url, e)
    except ArgumentError as e:  # not a URL at all: nothing to start ("start it" was the advice)
        return Unusable(f"{_first_line(e, url)}; write one such as postgresql+psycopg2://user@host:5432/db")
    except Exception as e:
        return _first_line(e, url)
    return None


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
    bad = unreadable(url, _kombu_parts)  # redis-py reads a URL as kombu does, less the ';' split
    if bad:
        return bad
    if url.startswith(("redis://", "rediss://")):
        import redis

        try:
            redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S).ping()
        except Exception as e:
            return _first_line(e, url)
        return None
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=TIMEOUT_S) as conn:
            conn.ensure_connection(max_retries=1, timeout=TIMEOUT_S)
    except Exception as e:
        return _first_line(e, url)
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
