"""The real-size route end to end on CPU (issue 24 item 6) through `airflow dags test`: a model that does not fit
the simulated device (hardware.device_memory_gb) — smoke trains a derived sibling, plan shards the real model over 4
ranks, the rehearsal at that layout passes, train runs it, and export, quantize and evaluate run on its export."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.dags import dags_test

ROUTE = {  # ci-tiny with the demo model, 4 gloo ranks, each "device" 0.22 GB (the demo needs more on one)
    "hardware": {"nproc_per_node": 4, "device_memory_gb": 0.22},
    "model": {"preset": "demo"},
    "parallel": {},  # the planner chooses
    "train": {"precision": "fp32", "steps": 4, "global_batch": 8, "micro_batch": 2, "checkpoint_every": 2},
    "smoke": {"steps": 6, "memory_margin": 0.4},
}


@pytest.mark.slow
def test_a_model_too_big_for_one_device_goes_the_whole_route(tmp_path, airflow_db):
    cfg = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    for section, values in ROUTE.items():
        cfg[section] = {**cfg.get(section, {}), **values} if values else {}
    preset = tmp_path / "route.yaml"
    preset.write_text(yaml.safe_dump(cfg))
    out = dags_test("llm_pipeline", {}, tmp_path, extra_env={"LLM_PIPELINE_PRESET": str(preset)}, timeout=1500)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    run_dir = next((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    res = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("smoke", "plan", "train", "quantize")}
    res["evaluate"] = json.loads((run_dir / "evaluate.json").read_text())

    sibling = res["smoke"]["smoke_model"]
    assert sibling["derived_from"] == "demo" and sibling["hidden"] * sibling["layers"] < 128 * 4, sibling  # demo: 128×4
    plan = json.loads((run_dir / "plan" / "plan.json").read_text())["chosen"]
    assert plan["dp"] * plan["tp"] * plan["pp"] == 4 and (plan["tp"] > 1 or plan["pp"] > 1 or plan["zero"] > 0)
    rehearsal = json.loads((run_dir / "train" / "rehearsal.json").read_text())
    assert rehearsal["ok"] and len(rehearsal["peaks_per_rank"]) == 4 and res["train"]["rehearsal"]["rehearsal.ok"]
    assert max(rehearsal["held_per_rank"]) <= 0.22e9 and res["train"]["steps"] == 4
    assert res["quantize"]["model_dir"] == res["evaluate"]["model_dir"] == res["train"]["hf_dir"]
    assert all(r["status"] in ("ok", "warn") for r in res.values()), {s: r["summary"] for s, r in res.items()}
