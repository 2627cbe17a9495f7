"""Smoke stage on a real webdataset shard set, real MLflow: passes on the demo model, fails naming the bad layer."""

from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest
import torch

from tasks.cli import main as cli_main
from tasks.errors import StageError
from tasks.runner import run_stage

SEQ = 128


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A real shard set (BPE over Python's own sources) built by data_prep's test helper, shared by this module."""
    from data_prep.testing import tiny_shard_set

    return tiny_shard_set(tmp_path_factory.mktemp("shards"), seq_len=SEQ, vocab_size=2048, n_docs=30)


@pytest.fixture
def smoke_cfg(cfg):
    cfg.model.preset = "debug"
    cfg.smoke.steps, cfg.smoke.micro_batch, cfg.smoke.window = 8, 2, 3
    return cfg


def _args(shard_dir):
    return argparse.Namespace(shard_dir=shard_dir and str(shard_dir))


def _mlflow(cfg):
    import mlflow

    return mlflow.MlflowClient(cfg.tracking.uri)


@pytest.mark.slow
def test_smoke_passes_on_demo_model(cfg, tmp_path, shards):
    assert (cfg.model.preset, cfg.smoke.steps, cfg.data.seq_len) == ("demo", 15, SEQ)
    result = run_stage("smoke", cfg, tmp_path / "run", args=_args(shards))
    assert result["status"] == "ok", result["summary"]
    fp32, bf16 = result["losses"]["fp32"], result["losses"]["bf16"]
    assert len(fp32) == len(bf16) == 15 and all(map(math.isfinite, fp32 + bf16))
    assert result["figures"]["fp32.loss_drop"] >= cfg.smoke.min_drop
    assert result["figures"]["bf16.max_rel_gap"] <= cfg.smoke.bf16_tolerance
    assert result["tokens_per_s"]["fp32"] > 0 and result["peak_memory_bytes"] > 0
    assert result["converters"] == ["npu_fused(identity)"]  # model.converters as smoke applied them (off the NPU)
    client = _mlflow(cfg)
    history = client.get_metric_history(result["mlflow_run_id"], "smoke.bf16.loss")
    assert [m.step for m in history] == list(range(15))
    assert [round(m.value, 5) for m in history] == bf16
    assert "smoke/smoke_loss.png" in [f.path for f in client.list_artifacts(result["mlflow_run_id"], "smoke")]


def test_huge_learning_rate_fails_naming_first_bad_layer(smoke_cfg, tmp_path, shards):
    smoke_cfg.smoke.lr, smoke_cfg.train.grad_clip = 1e6, 0.0
    with pytest.raises(StageError) as e:
        run_stage("smoke", smoke_cfg, tmp_path / "run", args=_args(shards))
    report = json.loads((tmp_path / "run" / "smoke_report.json").read_text())
    first = next(r for r in report["layers"] if r["nan"] or r["inf"])
    # Named: the first module with a non-finite output, or its parent when NaN/Inf arose in the parent's own code
    # between submodules (attention scores/softmax overflow under a huge learning rate).
    named = report["first_bad_layer"]
    assert named == (first["layer"].rpartition(".")[0] if first["input_nan_inf"] else first["layer"])
    assert named.startswith("layers.") and first["layer"].startswith(named)
    assert f"first non-finite layer {named} " in str(e.value) and "learning rate" in str(e.value)
    assert report["step"] > 0 and report["likely_causes"][0] == "learning_rate"
    assert all(r["nan"] == r["inf"] == 0 for r in report["layers"][: report["layers"].index(first)])
    run_id = json.loads((tmp_path / "run" / "smoke.json").read_text())["mlflow_run_id"]
    names = [f.path for f in _mlflow(smoke_cfg).list_artifacts(run_id, "smoke")]
    assert "smoke/layer_report.json" in names


def test_poisoned_checkpoint_names_the_poisoned_layer(tmp_path, capsys, shards):
    """An HF checkpoint whose layer-1 down projection holds Inf: the CLI fails naming exactly that layer."""
    from tasks.model import build_model, get_preset, materialize
    from tasks.model.hf_io import save_hf

    tcfg = get_preset("debug")
    tcfg.vocab_size = 2048
    model = materialize(build_model(tcfg), "cpu", seed=0)
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[3, 5] = float("inf")
    save_hf(model, tmp_path / "poisoned")
    code = cli_main(
        [
            "smoke",
            "--shard-dir",
            str(shards),
            "--run-dir",
            str(tmp_path / "run"),
            "--no-tracking",
            "--set",
            f"model.hf_path={tmp_path / 'poisoned'}",
            "--set",
            "smoke.steps=4",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "FP32 loss nan at step 0; first non-finite layer layers.1.feed_forward.w2 (output of" in err
    assert "data or weights" in err


def test_bad_inputs_fail_in_one_line(smoke_cfg, tmp_path, shards):
    smoke_cfg.tracking.enabled = False
    with pytest.raises(StageError, match="run `python -m tasks shard`"):
        run_stage("smoke", smoke_cfg, tmp_path / "run0", args=_args(None))
    smoke_cfg.model.vocab_size = 1000  # the shard set's tokenizer has 2048 tokens
    with pytest.raises(StageError, match="tokenizer has 2048 tokens but the model embedding only 1000"):
        run_stage("smoke", smoke_cfg, tmp_path / "run1", args=_args(shards))
    smoke_cfg.model.vocab_size = None
    (tmp_path / "empty").mkdir()
    with pytest.raises(StageError, match=r"empty is not a shard set \(no manifest.json\)$"):
        run_stage("smoke", smoke_cfg, tmp_path / "run2", args=_args(tmp_path / "empty"))
    shutil.copytree(shards, tmp_path / "no-tokenizer")
    (tmp_path / "no-tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(StageError, match="has no tokenizer.json"):
        run_stage("smoke", smoke_cfg, tmp_path / "run2b", args=_args(tmp_path / "no-tokenizer"))
    smoke_cfg.smoke.micro_batch = 100_000
    with pytest.raises(StageError, match="not one batch of 100000"):
        run_stage("smoke", smoke_cfg, tmp_path / "run3", args=_args(shards))


def test_likely_causes_follow_the_evidence():
    from tasks.model.diagnose import likely_causes

    assert likely_causes("bf16", 7, fp32_clean=True)[:2] == ["bf16_range", "learning_rate"]
    assert likely_causes("fp32", 0, fp32_clean=False)[0] == "data"
    assert likely_causes("fp32", 3, fp32_clean=False) == ["learning_rate", "data"]
    assert likely_causes("bf16", 0, fp32_clean=False) == ["data", "learning_rate", "bf16_range"]


def test_a_checkpoint_whose_loss_rises_on_its_own_first_batches_fails_naming_them(smoke_cfg, tmp_path, shards):
    """From model.hf_path's weights the rise is read on the same batches (the first `window`, before the first step
    and after the last), not on later batches a corpus may make harder: AdamW at lr 1 moves each weight ~1 a step."""
    from tasks.model import build_model, get_preset, materialize
    from tasks.model.hf_io import save_hf

    tcfg = get_preset("debug")
    tcfg.vocab_size = 2048
    save_hf(materialize(build_model(tcfg), "cpu", seed=0), tmp_path / "ckpt")
    smoke_cfg.model.hf_path, smoke_cfg.smoke.lr, smoke_cfg.train.grad_clip = str(tmp_path / "ckpt"), 1.0, 0.0
    smoke_cfg.smoke.hf_max_loss_ratio = 1.5  # its random weights start at ln(vocab), not below as a trained model's
    with pytest.raises(StageError, match="FP32 loss rose from the checkpoint's: the first 3 batches' mean ") as e:
        run_stage("smoke", smoke_cfg, tmp_path / "run", args=_args(shards))
    report = json.loads((tmp_path / "run" / "smoke_report.json").read_text())
    before, after = report["revisit"]["fp32"]
    assert f"mean {before:.4f} → {after:.4f} after 8 steps" in str(e.value) and after > before * 1.02
