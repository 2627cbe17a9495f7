"""smoke.compare_with_cpu: one forward on the device (here the CPU in BF16) against FP32 on the CPU from the same
weights and batch, the first layer beyond tolerance named, the per-layer table in smoke_report.json and MLflow."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tasks.model import build_model, get_preset, materialize
from tasks.model import compare as cmp
from tasks.runner import run_stage


@pytest.fixture(scope="module")
def tiny():
    tcfg = get_preset("debug")
    model = materialize(build_model(tcfg), "cpu", seed=3)
    tokens = torch.randint(0, tcfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    return tcfg, model.state_dict(), tokens


def test_fp32_against_itself_is_exact(tiny):
    tcfg, state, tokens = tiny
    out = cmp.compare_with_cpu(tcfg, state, tokens, torch.device("cpu"), "fp32", 0.0)
    assert out["first_beyond"] is None and out["max_rel"] == 0.0
    names = [r["layer"] for r in out["layers"]]
    assert names[0] == "tok_embeddings" and names[-1] == "logits" and "layers.0" in names


def test_bf16_names_the_first_rounded_layer_and_stays_within_default_tolerance(tiny):
    tcfg, state, tokens = tiny
    strict = cmp.compare_with_cpu(tcfg, state, tokens, torch.device("cpu"), "bf16", 0.0)
    rows = {r["layer"]: r for r in strict["layers"]}
    assert rows["tok_embeddings"]["max_abs"] == 0.0  # a lookup: no rounding under autocast
    assert strict["first_beyond"].startswith("layers.0.")  # the first matmul is the first BF16 op
    assert 0 < strict["logits_max_rel"] < 0.05
    default = cmp.compare_with_cpu(tcfg, state, tokens, torch.device("cpu"), "bf16", 0.05)
    assert default["first_beyond"] is None, cmp.summary(default)
    assert "every layer within 5%" in cmp.summary(default)


def test_a_broken_layer_is_named_exactly(tiny):
    tcfg, state, tokens = tiny
    ref = cmp.capture(cmp._model(tcfg, state, torch.device("cpu")), tokens, torch.autocast("cpu", enabled=False))
    broken = dict(state)
    broken["layers.1.feed_forward.w2.weight"] = state["layers.1.feed_forward.w2.weight"] * 1.5
    got = cmp.capture(cmp._model(tcfg, broken, torch.device("cpu")), tokens, torch.autocast("cpu", enabled=False))
    out = cmp.compare(ref, got, 0.05)
    assert out["first_beyond"] == "layers.1.feed_forward.w2", out["first_beyond"]
    assert all(r["max_abs"] == 0.0 for r in out["layers"] if r["layer"].startswith("layers.0"))


@pytest.mark.slow
def test_smoke_stage_writes_the_table_to_report_and_mlflow(cfg, tmp_path):
    from data_prep.testing import tiny_shard_set

    shards = tiny_shard_set(tmp_path / "shards", seq_len=64, vocab_size=1024, n_docs=20)
    cfg.model.preset = "debug"
    cfg.smoke.steps, cfg.smoke.micro_batch, cfg.smoke.window = 6, 2, 2
    cfg.smoke.min_drop = 0.0
    cfg.smoke.compare_with_cpu, cfg.smoke.compare_tolerance = True, 0.0
    result = run_stage("smoke", cfg, tmp_path / "run", args=argparse.Namespace(shard_dir=str(shards)))
    assert result["status"] == "warn" and result["compare"]["first_beyond"].startswith("layers.0.")
    assert "compare: cpu BF16 vs CPU FP32: first layer beyond 0%" in result["summary"]
    assert result["op_support"]["fallback"] == [] and result["op_support"]["note"].startswith("cpu:")
    report = json.loads((tmp_path / "run" / "smoke_report.json").read_text())["compare"]
    assert report["layers"][-1]["layer"] == "logits" and all("max_rel" in r for r in report["layers"])
    import mlflow

    client = mlflow.MlflowClient(cfg.tracking.uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["smoke.compare.first_beyond"] == result["compare"]["first_beyond"]
    assert "smoke.compare.logits_max_rel" in run.data.metrics
    assert "smoke/op_support.json" in [f.path for f in client.list_artifacts(result["mlflow_run_id"], "smoke")]
    assert "smoke/compare.json" in [f.path for f in client.list_artifacts(result["mlflow_run_id"], "smoke")]
    series = client.get_metric_history(result["mlflow_run_id"], "smoke.compare.layer_max_rel")
    assert len(series) == 6  # tok_embeddings, layers.0, layers.1 (the debug preset's 2 blocks), norm, output, logits
