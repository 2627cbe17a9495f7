"""The whole main DAG through `airflow dags test` on CPU (the ci-tiny preset), read back from MLflow."""
import json
import os
import subprocess
from pathlib import Path

import mlflow
import pytest
import torch

from tasks.stages import STAGES

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_dags_test_runs_every_stage(tmp_path, airflow_db):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"), "MLFLOW_TRACKING_URI": uri}
    conf = json.dumps({"preset": "ci-tiny"})
    cmd = f"source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{conf}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]

    run_dirs = list((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    assert len(run_dirs) == 1
    results = {s: json.loads((run_dirs[0] / f"{s}.json").read_text()) for s in STAGES}
    assert all(r["status"] in ("ok", "warn") for r in results.values()), {s: r["summary"] for s, r in results.items()}

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    parents = client.search_runs([exp.experiment_id], "tags.`pipeline.kind` = 'parent'")
    assert len(parents) == 1
    assert parents[0].info.status == "FINISHED" and parents[0].data.tags["pipeline.outcome"] == "success"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(c.data.tags["pipeline.stage"] for c in children) == sorted(STAGES)
    assert {c.info.run_id for c in children} == {r["mlflow_run_id"] for r in results.values()}
    assert "Evaluation & registry" in log  # the summary table was printed


@pytest.mark.slow
def test_dags_test_runs_moe_demo_with_expert_parallelism(tmp_path, airflow_db):
    """The whole DAG on the MoE preset with ep 2 (the issue's `make run CONF='{"model_preset": "moe-demo", "ep": 2}'`,
    on ci-tiny's small data and steps): every stage handles the mixture of experts — the MoE planner hands ep to
    training, training runs dp2·ep2 and logs the load-balancing loss to MLflow, the profile counts the all-to-alls
    as communication and evaluates the expert-imbalance rule on the router statistics, quantization puts every
    layer's experts in INT8 weight-only, and evaluation gates and registers that model."""
    from tasks.quant.artifact import WEIGHTS, load_quantized

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"), "MLFLOW_TRACKING_URI": uri}
    conf = json.dumps({"preset": "ci-tiny", "model_preset": "moe-demo", "ep": 2})
    cmd = f"source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{conf}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    [run_dir] = list((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    results = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in STAGES}
    assert all(r["status"] in ("ok", "warn") for r in results.values()), {s: r["summary"] for s, r in results.items()}

    plan = json.loads((run_dir / "plan" / "plan.json").read_text())
    assert plan["moe"] is True and results["plan"]["parallel"]["ep"] == 2  # the MoE planner sized it
    assert results["train"]["layout"] == "dp2·ep2"
    assert "layout dp2·ep2 coords" in (run_dir / "logs" / "rank-1.log").read_text()
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(sum(r["moe_tokens_per_expert"]["0"]) == 4 * 64 * 2 for r in records)  # global batch × seq × top-2

    client = mlflow.MlflowClient(uri)
    train_run = client.get_run(results["train"]["mlflow_run_id"])
    moe_metrics = {"train.moe_aux_loss", "train.moe_load_max_over_mean", "train.moe_dropped_frac"}
    assert moe_metrics <= set(train_run.data.metrics)  # the load-balancing loss reached MLflow
    assert [m.step for m in client.get_metric_history(train_run.info.run_id, "train.moe_aux_loss")] == list(range(1, 7))

    profile = json.loads((run_dir / "profile" / "report.json").read_text())
    assert profile["step"]["all_to_all_us_per_step"] > 0 and results["profile"]["all_to_all_share"] > 0
    assert profile["moe"]["steps"] >= 1 and sorted(profile["moe"]["by_layer_max_over_mean"]) == ["0", "1", "2", "3"]
    assert results["profile"]["moe_load_max_over_mean"] == pytest.approx(profile["moe"]["max_over_mean"], abs=1e-3)
    assert "profile.all_to_all_share" in client.get_run(results["profile"]["mlflow_run_id"]).data.metrics

    quant_dir = Path(results["quantize"]["quant_dir"])
    meta = json.loads((quant_dir / "quant_meta.json").read_text())
    experts = [f"layers.{i}.moe.experts" for i in range(4)]
    assert set(experts) <= set(meta["quantized_layers"]) and meta["layer_types"][experts[0]] == "GroupedExperts"
    assert (quant_dir / WEIGHTS).stat().st_size < 0.5 * meta["fp32_bytes"]
    ev = results["evaluate"]
    for gated in {quant_dir, Path(ev["quant_dir"])}:  # PTQ's model, and QAT's if PTQ missed the gate
        model = load_quantized(gated)
        for name in experts:
            for w in ("w1", "w2", "w3"):
                t = model.get_submodule(name).get_parameter(w)
                assert type(t).__module__.startswith("torchao") and t.qdata.dtype == torch.int8, (gated, name, w)
    assert ev["passed"] and ev.get("version"), ev  # gated, then registered
    assert client.get_model_version(ev["registered_model"], ev["version"]).status == "READY"


@pytest.mark.slow
def test_failed_stage_stops_the_run_and_notifies_its_cause(tmp_path, airflow_db):
    var = tmp_path / "var"
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(var), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    conf = json.dumps({"preset": "ci-tiny", "data_inputs": [str(tmp_path / "no-such-corpus")]})
    cmd = f"source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{conf}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    run_dir = next((var / "runs" / "llm_pipeline").iterdir())
    shard = json.loads((run_dir / "shard.json").read_text())
    assert shard["status"] == "failed" and "no-such-corpus" in shard["error"], shard
    assert not (run_dir / "smoke.json").exists()  # nothing downstream of a failed stage ran
    notes = [json.loads(line) for line in (var / "notifications.jsonl").read_text().splitlines()]
    assert [(n["stage"], n["cause"]) for n in notes] == [("shard", shard["error"])]
    assert "Evaluation & registry" in out.stdout + out.stderr  # the summary still printed


@pytest.mark.slow
def test_data_dag_publishes_only_new_shard_sets(tmp_path, airflow_db):
    """llm_data attaches a new shard set to the asset alias that schedules llm_pipeline; a cache hit publishes
    nothing, so a re-shard that changed nothing never starts a retraining."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from sqlalchemy import select

    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    cmd = "source scripts/airflow-env.sh && airflow dags test llm_data --conf '{\"preset\": \"ci-tiny\"}'"
    results = []
    for _ in range(2):
        out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        run_dir = max((tmp_path / "var" / "runs" / "llm_data").iterdir(), key=lambda p: p.stat().st_mtime)
        results.append(json.loads((run_dir / "shard.json").read_text()))
    assert [r["cache_hit"] for r in results] == [False, True]
    with create_session() as session:
        events = [e for e in session.scalars(select(AssetEvent)) if str(tmp_path) in e.asset.uri]
        assert [(e.asset.uri, e.extra.get("manifest_digest")) for e in events] == \
            [(results[0]["asset_uri"], results[0]["manifest_digest"])]
