"""Smoke on the real-size route: a model that does not fit one device runs on its derived sibling; a loaded
checkpoint's own first forward must score far below ln(vocab); FP32 → FP16 where FP16 is the 16-bit precision."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import struct

import pytest
import torch

from tasks.errors import ConfigError, StageError
from tasks.runner import run_stage
from tasks.stages.smoke import low_precision

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SEQ, VOCAB = 64, 512


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from data_prep.testing import tiny_shard_set

    return tiny_shard_set(tmp_path_factory.mktemp("shards"), seq_len=SEQ, vocab_size=VOCAB, n_docs=30)


def _args(shard_dir):
    return argparse.Namespace(shard_dir=str(shard_dir))


def _small(cfg, **sets):
    cfg.smoke.steps, cfg.smoke.micro_batch, cfg.smoke.window = 8, 2, 3
    for k, v in sets.items():
        section, _, key = k.partition(".")
        setattr(getattr(cfg, section), key, v)
    return cfg


def test_a_model_that_does_not_fit_smokes_on_its_sibling(cfg, tmp_path, shards):
    """Llama-2-13B's shape (~210 GB in FP32 AdamW) on a 0.25 GB "device": smoke runs a 2-layer, 256-wide sibling."""
    import mlflow

    cfg = _small(cfg, **{"model.preset": "llama-13b", "hardware.device_memory_gb": 0.25})
    result = run_stage("smoke", cfg, tmp_path / "run", args=_args(shards))
    assert result["status"] == "ok", result["summary"]
    sm = result["smoke_model"]
    assert (sm["derived_from"], sm["family"], sm["layers"], sm["vocab"]) == ("llama-13b", "llama", 2, VOCAB)
    assert sm["heads"] == sm["kv_heads"] == 2 and sm["hidden"] == 128 * sm["heads"]  # MHA and head size kept
    assert "llama-13b does not fit one device" in sm["why"] and result["params"] == sm["params"] < 2e6
    assert "sibling of llama-13b" in result["summary"]
    fp32 = result["losses"]["fp32"]
    assert all(map(math.isfinite, fp32)) and result["figures"]["fp32.loss_drop"] >= cfg.smoke.min_drop
    assert json.loads((tmp_path / "run" / "smoke.json").read_text())["smoke_model"] == sm
    run = mlflow.MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"])
    assert run.data.params["smoke_model.derived_from"] == "llama-13b"
    assert run.data.params["smoke_model.layers"] == "2"


def test_smoke_lr_scales_one_over_width_above_lr_width(cfg):
    from tasks.model.config import get_preset
    from tasks.stages.smoke import smoke_lr

    lrs = {d: smoke_lr(cfg, dataclasses.replace(get_preset("demo"), dim=d, n_heads=d // 64)) for d in (128, 256, 1024)}
    assert lrs == {128: cfg.smoke.lr, 256: cfg.smoke.lr, 1024: pytest.approx(cfg.smoke.lr / 4)}
    cfg.smoke.lr_width = 0
    assert smoke_lr(cfg, dataclasses.replace(get_preset("demo"), dim=1024, n_heads=16)) == cfg.smoke.lr


def test_fp16_is_the_16_bit_curve_when_training_asks_for_it(cfg, tmp_path, shards):
    cfg = _small(cfg, **{"model.preset": "debug", "train.precision": "fp16"})
    result = run_stage("smoke", cfg, tmp_path / "run", args=_args(shards))
    assert result["status"] == "ok" and result["precisions"] == ["fp32", "fp16"], result["summary"]
    assert result["figures"]["fp16.max_rel_gap"] <= cfg.smoke.bf16_tolerance and "FP16 within" in result["summary"]
    assert result["smoke_model"]["why"].startswith("the configured model fits")
    import mlflow

    # The FP16 curve ran with training's loss scaler (tasks/train/loss_scale.py): its state in smoke.json and MLflow.
    assert result["loss_scaler"] == {
        "fp16": {
            "scale": 2.0**16,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": cfg.smoke.steps,
            "skipped_steps": 0,
        }
    }
    assert json.loads((tmp_path / "run" / "smoke.json").read_text())["loss_scaler"] == result["loss_scaler"]
    client = mlflow.MlflowClient(cfg.tracking.uri)
    scales = client.get_metric_history(result["mlflow_run_id"], "smoke.fp16.loss_scale")
    assert sorted(m.step for m in scales) == list(range(cfg.smoke.steps)) and {m.value for m in scales} == {2.0**16}


def test_smoke_fp16_skips_overflowing_steps_as_training_does(cfg, shards):
    """A loss scale far too high for FP16 (2^28: the scaled logits' gradient overflows FP16's 65504) makes the first
    steps overflow: each is skipped, counted and halves the scale, as in training, until the scale fits; the curve
    goes on with finite losses and no failure (without the scaler's skip it would stop at step 0 on a non-finite
    gradient norm)."""
    from tasks.model import from_pipeline
    from tasks.stages.smoke import initial_model, load_batches, run_curve
    from tasks.train.loss_scale import LossScaler

    cfg = _small(cfg, **{"model.preset": "debug", "train.precision": "fp16"})
    cfg.smoke.steps = 24
    batches = load_batches(shards, cfg.smoke.steps, cfg.smoke.micro_batch, cfg.train.seed)
    tcfg = from_pipeline(cfg, vocab_size=VOCAB)
    state = initial_model(cfg, tcfg, own_weights=False)
    scaler = LossScaler(scale=2.0**28)
    curve = run_curve("fp16", tcfg, state, batches, torch.device("cpu"), cfg, fp32_clean=True, scaler=scaler)
    skipped = curve.loss_scaler["skipped_steps"]
    assert curve.failure is None and len(curve.losses) == cfg.smoke.steps and all(map(math.isfinite, curve.losses))
    assert 4 <= skipped <= cfg.smoke.steps - 8 and curve.loss_scaler["scale"] == 2.0 ** (28 - skipped)
    assert 1 <= curve.loss_scaler["_growth_tracker"] <= cfg.smoke.steps - skipped  # the last steps updated
    k = 4
    assert sum(curve.losses[-k:]) < sum(curve.losses[:k])  # and the loss fell once it trained


def test_16_bit_precision_choice():
    assert low_precision("cpu", "bf16", True, True) == ("bf16", None)
    assert low_precision("npu", "bf16", False, True) == ("fp16", None)  # 910 A1: no BF16, FP16 with loss scaling
    assert low_precision("npu", "fp32", False, True) == ("fp16", None)
    assert low_precision("cpu", "fp16", True, True) == ("fp16", None)
    assert low_precision("cuda", "bf16", False, False) == (None, None)  # FP32 only
    precision, problem = low_precision("cuda", "fp16", True, False)
    assert precision is None and problem == (
        "train.precision: fp16 is not supported on this cuda device (no FP16 kernels): use bf16 or fp32"
    )


# A checkpoint of our own tokenizer, trained briefly by transformers: its loss is really below ln(V).


def _train_llama(shards, path, steps=100):
    import transformers

    from data_prep.loader import ShardLoader

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(hf_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ShardLoader(shards, split="train", batch_size=8, seed=1)
    for _, (x, y) in zip(range(steps), loader.batches()):
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path)
    shutil.copy(shards / "tokenizer.json", path / "tokenizer.json")
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shards):
    path = tmp_path_factory.mktemp("ckpt") / "trained"
    return path, _train_llama(shards, path)


def _first_batch(cfg, shards):
    from tasks.stages.smoke import load_batches

    return load_batches(shards, 1, cfg.smoke.micro_batch, cfg.train.seed)[0]


@pytest.mark.slow
def test_a_trained_checkpoint_starts_far_below_ln_vocab(cfg, tmp_path, shards, trained):
    path, hf = trained
    cfg = _small(cfg, **{"model.hf_path": str(path), "smoke.steps": 4, "smoke.window": 2})
    result = run_stage("smoke", cfg, tmp_path / "run", args=_args(shards))
    ck = result["checkpoint"]
    assert ck["layers"] == ck["of_layers"] == 2 and ck["nonfinite_layer"] is None
    assert ck["ln_vocab"] == pytest.approx(math.log(VOCAB)) and ck["ratio"] <= cfg.smoke.hf_max_loss_ratio
    x, y = _first_batch(cfg, shards)
    with torch.no_grad():  # transformers' own loss of the same weights on the same batch
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert ck["loss"] == pytest.approx(want, abs=1e-4)
    assert result["smoke_model"]["why"].startswith("the configured model fits")
    assert result["summary"].startswith(f"checkpoint loss {ck['loss']:.2f}")
    assert result["losses"]["fp32"][0] == pytest.approx(want, abs=1e-3)  # the curve starts from those weights


def _smoke_fails(cfg, tmp_path, shards, path, match):
    cfg = _small(cfg, **{"model.hf_path": str(path), "tracking.enabled": False})
    with pytest.raises(StageError) as e:
        run_stage("smoke", cfg, tmp_path / "run", args=_args(shards))
    assert match in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run" / "smoke_loss.png").exists()  # failed before any training
    return str(e.value)


def test_wrong_weight_mapping_fails_before_training(cfg, tmp_path, shards, trained):
    """Embedding and head swapped (same shape, both vocab × hidden): the classic mis-mapped name."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "swapped"
    shutil.copytree(trained[0], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = (
        tensors["lm_head.weight"],
        tensors["model.embed_tokens.weight"],
    )
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    line = _smoke_fails(cfg, tmp_path, shards, path, "model.hf_path: the checkpoint's initial loss on the shard set")
    assert "ln(vocab 512)" in line and "smoke.hf_max_loss_ratio 0.8" in line


def test_wrong_tokenizer_fails_before_training(cfg, tmp_path, shards, trained):
    """Shards from a tokenizer whose ids mean other tokens (the same strings, ids permuted), with a checkpoint that
    ships no tokenizer.json to compare: only the loss can tell."""
    from data_prep.build import build_shard_set
    from data_prep.config import ShardConfig

    tok = json.loads((shards / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok.get("added_tokens", [])}
    movable = sorted((i, s) for s, i in vocab.items() if s not in special)
    ids = [i for i, _ in movable]
    for (_, s), new in zip(movable, ids[::-1]):
        vocab[s] = new
    (tmp_path / "permuted.json").write_text(json.dumps(tok))
    other = build_shard_set(
        ShardConfig(
            inputs=["stdlib"],
            out_dir=str(tmp_path / "data"),
            max_documents=30,
            seq_len=SEQ,
            tokenizer=str(tmp_path / "permuted.json"),
            shard_multiple=4,
            shard_size_mb=0.25,
            tokenize_processes=1,
            progress=False,
        )
    ).shard_dir
    path = tmp_path / "no-tokenizer"
    shutil.copytree(trained[0], path)
    (path / "tokenizer.json").unlink()
    _smoke_fails(cfg, tmp_path, other, path, "model.hf_path: the checkpoint's initial loss on the shard set")


def test_untrained_or_truncated_checkpoint_fails_before_training(cfg, tmp_path, shards, trained):
    import transformers

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(trained[0]))
    hf.save_pretrained(tmp_path / "random")
    shutil.copy(shards / "tokenizer.json", tmp_path / "random" / "tokenizer.json")
    _smoke_fails(cfg, tmp_path / "a", shards, tmp_path / "random", "initial loss on the shard set is")

    path = tmp_path / "truncated"
    shutil.copytree(trained[0], path)
    data = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    (path / "model.safetensors").write_bytes(data[: 8 + n + (len(data) - 8 - n) // 2])
    _smoke_fails(cfg, tmp_path / "b", shards, path, "the file is truncated or not a valid safetensors file")


def test_checkpoint_loss_through_its_first_block_only(trained, shards, cfg):
    from tasks.model import checkpoint_check
    from tasks.model.hf_io import read_hf_config

    x, y = _first_batch(cfg, shards)
    tcfg = read_hf_config(trained[0])
    one = checkpoint_check.initial_loss(trained[0], tcfg, x, y, layers=1)
    both = checkpoint_check.initial_loss(trained[0], tcfg, x, y, layers=0)
    assert (one["layers"], both["layers"]) == (1, 2) and one["loss"] != both["loss"]
    assert checkpoint_check.problem(both, 0.8, trained[0]) is None
    assert "through its first 1 blocks" in (checkpoint_check.problem(one, 0.01, trained[0]) or "")


def test_smoke_model_naming_another_family_fails_in_one_line(cfg, tmp_path, shards):
    cfg = _small(cfg, **{"model.preset": "llama3-8b", "smoke.model": "qwen2-0.5b", "tracking.enabled": False})
    with pytest.raises(ConfigError, match=r"^smoke.model: preset 'qwen2-0.5b' is family qwen2"):
        run_stage("smoke", cfg, tmp_path / "run", args=_args(shards))


@pytest.mark.parametrize("preset, tied", [("debug", False), ("debug", True), ("moe-demo", False)])
def test_streamed_first_forward_is_the_models_own(tmp_path, preset, tied):
    """Block by block from the files (dense, tied, mixture of experts) = the whole model's loss in one process."""
    from tasks.model import build_model, checkpoint_check, get_preset, materialize
    from tasks.model.hf_io import save_hf
    from tasks.model.loss import lm_loss

    tcfg = dataclasses.replace(get_preset(preset), vocab_size=VOCAB, tie_embeddings=tied)
    model = materialize(build_model(tcfg), "cpu", seed=3).eval()
    save_hf(model, tmp_path / "ckpt")
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        want = lm_loss(model(x), y).item()
    got = checkpoint_check.initial_loss(tmp_path / "ckpt", tcfg, x, y)
    assert got["loss"] == pytest.approx(want, abs=1e-5) and got["layers"] == tcfg.n_layers


def test_a_trained_checkpoint_must_not_rise_random_weights_must_fall(cfg):
    from tasks.stages.smoke import Curve, verdict

    cfg.smoke.steps, cfg.smoke.window, cfg.smoke.min_drop = 6, 3, 0.02
    flat = {"fp32": Curve("fp32", [3.62, 3.60, 3.63, 3.61, 3.62, 3.63])}  # the e2e checkpoint's curve, roughly
    rising = {"fp32": Curve("fp32", [3.6, 3.6, 3.6, 3.8, 3.8, 3.8])}
    assert verdict(flat, cfg, pretrained=True)[0] == []
    assert verdict(flat, cfg)[0][0].startswith("FP32 loss did not fall: mean of first 3 3.6167 → last 3 3.6200")
    (line,) = verdict(rising, cfg, pretrained=True)[0]
    assert line.startswith("FP32 loss rose from the checkpoint's: mean of first 3 3.6000 → last 3 3.8000 (-5.6% < ")
    # With the first batches revisited after training (the stage's own curves), the rule reads those: a hard batch
    # late in the run (the e2e checkpoint's on CPython 3.11.2's standard library: 4.25 among 3.4-3.8) is no rise, the
    # same batches' loss rising is.
    noisy = [3.76, 3.49, 3.59, 3.64, 3.41, 3.44, 4.25, 3.66, 3.83, 3.56]
    cfg.smoke.steps, cfg.smoke.window = 10, 5
    assert verdict({"fp32": Curve("fp32", noisy)}, cfg, pretrained=True)[0]  # first 5 vs last 5: -4.8 %
    assert verdict({"fp32": Curve("fp32", noisy, revisit=[3.578, 3.571])}, cfg, pretrained=True)[0] == []
    (line,) = verdict({"fp32": Curve("fp32", noisy, revisit=[3.578, 3.75])}, cfg, pretrained=True)[0]
    assert line.startswith("FP32 loss rose from the checkpoint's: the first 5 batches' mean 3.5780 → 3.7500 after 10")


def test_the_real_size_docs_state_the_8b_estimate_with_its_conditions():
    """docs/real-size.md gave "≈ 135 GB by the planner's estimate" for Llama-3-8B at seq 128: that is micro-batch 4
    (demo-cpu's smoke.micro_batch, smoke's line); estimate_for_run at micro-batch 1 gives 130.1 GB. Both, each with
    its micro-batch."""
    from pathlib import Path

    from tasks.config import load_config
    from tasks.model.config import get_preset
    from tasks.planner import estimate_for_run

    text = (Path(__file__).resolve().parents[1] / "docs" / "real-size.md").read_text(encoding="utf-8")
    shape = get_preset("llama3-8b")
    one = estimate_for_run(shape, 128, 1, precision="fp32") / 1e9
    smoke_mb = load_config("demo-cpu").smoke.micro_batch
    smoke = estimate_for_run(shape, 128, smoke_mb, precision="fp32") / 1e9
    assert f"{one:.1f} GB at micro-batch 1, {smoke:.1f} GB at demo-cpu's `smoke.micro_batch` {smoke_mb}" in " ".join(
        text.split()
    )
