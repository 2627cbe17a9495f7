"""Every Airflow process of this deployment runs the cyclic garbage collector as plugins/airflow_local_settings.py
sets it (Airflow's own hook, imported at `import airflow`): full passes 10x rarer, and none at exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The exit check is registered before Airflow is imported, so it runs after the hook's atexit handler (LIFO).
PROCESS = """
import atexit, gc, json, sys
atexit.register(lambda: print(json.dumps({"frozen_at_exit": gc.get_freeze_count()})))
import airflow.settings
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "settings_untouched": not hasattr(airflow.settings, "FULL_PASS_EVERY")}))
"""


def test_an_airflow_process_has_rarer_full_passes_and_none_at_exit(tmp_path):
    from plugins.airflow_local_settings import FULL_PASS_EVERY

    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
    }
    out = subprocess.run(
        [sys.executable, "-c", PROCESS], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    started, ended = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert started["threshold"][2] == FULL_PASS_EVERY == 100, started
    assert started["frozen"] == 0 and started["settings_untouched"], started  # nothing frozen while it runs
    assert ended["frozen_at_exit"] > 100_000, ended  # everything frozen before the teardown's passes
