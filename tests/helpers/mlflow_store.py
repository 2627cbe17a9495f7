"""Fresh SQLite MLflow stores for the tests: each a copy of one empty store that MLflow migrated once per session.

MLflow brings a new SQLite store to its schema with its alembic migrations, 2.4-4.2 CPU s (measured on the 2-core
host) in whichever process opens the store first; a test that gives its DAG run or stage a store of its own paid that
again. The session's first asker has MLflow create one (its own code, in a fresh process, from the repository as the
stages run) and every test copies that file: the store MLflow would have made, empty until the test's run writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.dags import REPO, once

ROOT_ENV = "LLM_PIPELINE_TEST_SESSION_ROOT"  # set by tests/conftest.py: the directory every xdist worker shares


def _migrate(tmp: Path) -> dict:
    db = tmp / "mlflow.db"
    code = "import sys, mlflow; mlflow.MlflowClient('sqlite:///' + sys.argv[1]).search_experiments()"
    out = subprocess.run([sys.executable, "-c", code, str(db)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and db.is_file(), out.stderr[-3000:]
    return {"db": str(db)}


def fresh_store(path: Path) -> str:
    """The sqlite URI of a new, migrated, empty MLflow store at `path` (a store already there is left as it is)."""
    if not path.exists():
        template = once(Path(os.environ[ROOT_ENV]), "mlflow-template", _migrate)["db"]
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
    return f"sqlite:///{path}"
