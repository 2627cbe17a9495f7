"""Training starts from the weights of model.hf_path (not from the project's random init): a tiny Qwen2 written by
transformers, trained one step at learning rate 0 through the CLI on 2 gloo ranks and exported, comes back equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tests.helpers.models import tiny_qwen2
from tests.helpers.train_fixture import shards  # noqa: E402,F401


@pytest.mark.slow
def test_train_starts_from_hf_path_weights(tmp_path, shards):  # noqa: F811
    import transformers

    from safetensors.torch import load_file

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    hf = tiny_qwen2(tmp_path / "ckpt", vocab)
    run_dir = tmp_path / "run"
    sets = {
        "model.hf_path": tmp_path / "ckpt",
        "data.seq_len": 32,
        "data.loader_workers": 0,
        "train.steps": 1,
        "train.global_batch": 4,
        "train.micro_batch": 2,
        "train.precision": "fp32",
        "train.lr": 0.0,
        "train.min_lr": 0.0,
        "train.warmup_steps": 0,
        "hardware.device": "cpu",
        "hardware.nproc_per_node": 2,
        "parallel.dp": 2,
        "parallel.tp": 1,
        "parallel.pp": 1,
    }
    cmd = [
        sys.executable,
        "-m",
        "tasks",
        "train",
        "--no-tracking",
        "--run-dir",
        str(run_dir),
        "--shard-dir",
        str(shards),
    ]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    want = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    got = {k: v for f in sorted((run_dir / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert (run_dir / "hf" / "model.safetensors.index.json").is_file()  # both ranks wrote a file
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{name} differs from the checkpoint's"
    back = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_shape_override_that_cannot_load_hf_path_is_refused(cfg, tmp_path, shards):  # noqa: F811
    from tasks.stages import train
    from tasks.errors import ConfigError
    from tests.helpers.train_fixture import configure, context

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    tiny_qwen2(tmp_path / "ckpt", vocab)
    c = configure(
        cfg,
        **{
            "model.hf_path": str(tmp_path / "ckpt"),
            "model.preset": "demo",
            "model.ffn_dim": 128,
            "hardware.nproc_per_node": 2,
        },
    )
    with pytest.raises(ConfigError, match="model.ffn_dim: 128 differs from 96 in model.hf_path's config.json"):
        train.prepare(c, context(tmp_path / "run", shards))


def test_checkpoint_whose_tokenizer_is_not_the_shard_sets_is_refused(cfg, tmp_path, shards):  # noqa: F811
    """The checkpoint's embedding rows are its own tokenizer's ids: a shard set of another tokenizer whose ids happen
    to fit would train on the wrong rows without a word. Refused in one line; the same tokenizer passes."""
    import shutil

    from tokenizers import Tokenizer

    from data_prep.tokenizer import train_bpe
    from tasks.stages import train
    from tasks.errors import ConfigError
    from tests.helpers.train_fixture import configure, context

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    tiny_qwen2(tmp_path / "ckpt", vocab)
    c = configure(cfg, **{"model.hf_path": str(tmp_path / "ckpt"), "hardware.nproc_per_node": 2})
    other = train_bpe(iter(["def f(x):\n    return x + 1\n"] * 4), 300)
    other.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    with pytest.raises(
        ConfigError,
        match=r"model.hf_path: its tokenizer \(\d+ tokens, .*ckpt/tokenizer.json\) is "
        r"not the shard set's \(512 tokens, .*\); shard with data.tokenizer=",
    ):
        train.prepare(c, context(tmp_path / "run", shards))
    Tokenizer.from_file(str(shards / "tokenizer.json")).save(str(tmp_path / "ckpt" / "tokenizer.json"), pretty=False)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() != (shards / "tokenizer.json").read_bytes()
    assert train.prepare(c, context(tmp_path / "run", shards))["init_from"] == str(tmp_path / "ckpt")
    shutil.copyfile(shards / "tokenizer.json", tmp_path / "ckpt" / "tokenizer.json")
    assert train.prepare(c, context(tmp_path / "run", shards))["init_from"] == str(tmp_path / "ckpt")
    # A checkpoint (without a tokenizer of its own) whose embedding is smaller than the shard set's vocabulary.
    tiny_qwen2(tmp_path / "small", 256)
    c = configure(cfg, **{"model.hf_path": str(tmp_path / "small"), "hardware.nproc_per_node": 2})
    with pytest.raises(
        ConfigError,
        match=r"model.hf_path: the shard set's tokenizer has 512 tokens but the "
        r"checkpoint's embedding only 256; shard with the checkpoint's own "
        r"tokenizer \(data.tokenizer=.*small\) — if that is the one, the checkpoint's tokenizer and its config.json's "
        r"vocab_size disagree: fix the checkpoint$",
    ):
        train.prepare(c, context(tmp_path / "run", shards))


def test_a_preset_set_beside_hf_path_is_said_unused(cfg, tmp_path, shards, caplog):  # noqa: F811
    """model.hf_path decides the shape: a model.preset set with it is not silently dropped, it is said."""
    import logging

    from tasks.config import apply_overrides, load_config
    from tasks.model.resolve import from_pipeline
    from tests.helpers.train_fixture import configure

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    tiny_qwen2(tmp_path / "ckpt", vocab)
    caplog.set_level(logging.WARNING)
    c = configure(cfg, **{"model.hf_path": str(tmp_path / "ckpt"), "model.preset": "qwen2-7b"})
    assert from_pipeline(c, vocab).dim == 64
    assert any(
        "model.preset qwen2-7b is not used: the model is model.hf_path's" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    fresh = apply_overrides(load_config("ci-tiny"), {"model.hf_path": str(tmp_path / "ckpt")})
    from_pipeline(fresh, vocab)  # the preset's own model.preset, not set by the caller: nothing said
    assert not any("is not used" in r.getMessage() for r in caplog.records)


def test_hf_paths_attention_dropout_is_said_unapplied(cfg, tmp_path, shards):  # noqa: F811
    """A checkpoint whose config.json asks for attention dropout trains without it (this model has none): the launch
    spec's warnings say so before training (tests/test_export_metadata.py: the export's config.json keeps the
    checkpoint's setting). A checkpoint without dropout: no warning."""
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    specs = {}
    for name, dropout in (("dropout", 0.1), ("plain", 0.0)):
        tiny_qwen2(tmp_path / name, vocab, attention_dropout=dropout)
        c = configure(cfg, **{"model.hf_path": str(tmp_path / name), "hardware.nproc_per_node": 1, "parallel.dp": 1})
        specs[name] = train.prepare(c, context(tmp_path / f"run-{name}", shards))
    [note] = [w for w in specs["dropout"]["warnings"] if "attention_dropout" in w]
    assert "attention_dropout 0.1" in note and "trains without it" in note, note
    assert not any("attention_dropout" in w for w in specs["plain"]["warnings"])
