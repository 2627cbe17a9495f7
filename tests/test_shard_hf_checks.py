"""model.hf_path is checked by the shard stage before anything is tokenized (an unsupported config.json, data.seq_len
over its context, a tokenizer not the checkpoint's or larger than its embedding), in the line smoke would give after
the set was built; and smoke's refusal of a checkpoint whose first loss is near ln(vocab) names the fix that applies."""

from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest

from tasks.errors import ConfigError, StageError
from tasks.runner import run_stage
from tests.helpers.models import stdlib_bpe, tiny_qwen2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny Qwen2 saved with its own tokenizer (384 tokens, context 128)."""
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    tiny_qwen2(path, tokenizer=stdlib_bpe(384))
    return path


def _variant(ckpt, tmp_path, name, weights=False, **config):
    """A copy of `ckpt` with config.json's `config` set (without its weights unless `weights`: the checks must
    not need them)."""
    path = tmp_path / name
    shutil.copytree(ckpt, path, ignore=None if weights else shutil.ignore_patterns("*.safetensors*"))
    hf = json.loads((path / "config.json").read_text())
    hf.update(config)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def _shard(cfg, tmp_path, hf_path, tokenizer=None):
    cfg.tracking.enabled = False
    cfg.data.seq_len, cfg.data.max_documents, cfg.data.tokenize_processes = 64, 30, 1
    cfg.model.hf_path = str(hf_path)
    cfg.data.tokenizer = str(tokenizer or hf_path)
    return run_stage("shard", cfg, tmp_path / "run", args=argparse.Namespace(shard_dir=None))


def _refused(cfg, tmp_path, hf_path, match, tokenizer=None, error=StageError):
    with pytest.raises(error) as e:
        _shard(cfg, tmp_path, hf_path, tokenizer)
    assert match in str(e.value) and "\n" not in str(e.value), str(e.value)
    out = tmp_path / "data"
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))  # nothing tokenized or written
    return str(e.value)


def test_unsupported_architecture_refused_before_tokenizing(cfg, tmp_path, ckpt):
    path = _variant(ckpt, tmp_path, "mistral", architectures=["MistralForCausalLM"], model_type="mistral")
    _refused(cfg, tmp_path, path, f"{path / 'config.json'}: unsupported architecture 'MistralForCausalLM'")


def test_unsupported_rope_scaling_refused_before_tokenizing(cfg, tmp_path, ckpt):
    path = _variant(ckpt, tmp_path, "linear", rope_scaling={"type": "linear", "factor": 2.0})
    _refused(cfg, tmp_path, path, "unsupported setting rope_type 'linear'")


def test_seq_len_over_max_position_embeddings_refused_before_tokenizing(cfg, tmp_path, ckpt):
    path = _variant(ckpt, tmp_path, "short", max_position_embeddings=32)
    _refused(cfg, tmp_path, path, "data.seq_len: 64 exceeds model max_seq_len 32", error=ConfigError)


def test_tokenizer_larger_than_the_embedding_refused_before_tokenizing(cfg, tmp_path, ckpt):
    path = _variant(ckpt, tmp_path, "few-rows", vocab_size=300)
    _refused(
        cfg,
        tmp_path,
        path,
        "model.hf_path: the shard set's tokenizer has 384 tokens but the checkpoint's embedding only 300",
        error=ConfigError,
    )


def test_missing_or_cut_weight_files_refused_before_tokenizing(cfg, tmp_path, ckpt):
    """The weight files as smoke and train will read them (headers only): none there, or one cut short."""
    bare = _variant(ckpt, tmp_path, "no-weights")
    _refused(cfg, tmp_path, bare, f"{bare}: no model.safetensors or model.safetensors.index.json")
    cut = _variant(ckpt, tmp_path, "cut", weights=True)
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(64)
    _refused(cfg, tmp_path, cut, str(cut / "model.safetensors"))


def test_train_tokenizer_beside_hf_path_refused_before_tokenizing(cfg, tmp_path, ckpt):
    line = _refused(cfg, tmp_path, ckpt, "model.hf_path: data.tokenizer is train", tokenizer="train", error=ConfigError)
    assert f"data.tokenizer={ckpt}" in line


def test_a_checkpoint_without_a_tokenizer_is_not_offered_as_its_own(cfg, tmp_path, ckpt):
    """Its fix named the checkpoint as data.tokenizer, which then failed with "no tokenizer.json found"."""
    bare = _variant(ckpt, tmp_path, "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    line = _refused(cfg, tmp_path, bare, "model.hf_path: data.tokenizer is train", tokenizer="train", error=ConfigError)
    assert line.endswith(
        f"{bare} holds no tokenizer.json: shard with data.tokenizer=<the tokenizer.json it was trained with, or a "
        "directory holding it>"
    )


def test_another_tokenizer_refused_before_tokenizing(cfg, tmp_path, ckpt):
    other = tmp_path / "other-tok"
    stdlib_bpe(300).save_pretrained(other)
    line = _refused(cfg, tmp_path, ckpt, "model.hf_path: its tokenizer (384 tokens", tokenizer=other, error=ConfigError)
    assert f"shard with data.tokenizer={ckpt} (the checkpoint's own)" in line


def test_checkpoint_with_its_own_tokenizer_shards(cfg, tmp_path, ckpt, monkeypatch):
    import tasks.stages.shard as shard

    monkeypatch.setattr(shard, "check_evaluation_data", lambda *a: None)  # evaluate.tasks are not what is tested
    result = _shard(cfg, tmp_path, ckpt)
    assert result["vocab_size"] == 384 and result["seq_len"] == 64 and result["train_samples"] > 0


def _result(ratio: float, vocab: int = 384) -> dict:
    ln_v = math.log(vocab)
    return {
        "loss": ratio * ln_v,
        "ln_vocab": ln_v,
        "ratio": ratio,
        "layers": 2,
        "of_layers": 2,
        "nonfinite_layer": None,
    }


def test_high_first_loss_on_the_checkpoints_own_tokenizer_names_the_ratio(tmp_path, ckpt):
    from tasks.model.checkpoint_check import problem

    for shard_dir in (ckpt, None):  # a set of its tokenizer; smoke's call (a set of another was refused before)
        line = problem(_result(0.95), 0.8, ckpt, shard_dir)
        assert "smoke.hf_max_loss_ratio (now 0.8) above 0.95" in line and "data.tokenizer=" not in line, line
    assert problem(_result(0.5), 0.8, ckpt, ckpt) is None


def test_high_first_loss_on_another_tokenizer_names_the_tokenizer(tmp_path, ckpt):
    from tasks.model.checkpoint_check import problem

    other = tmp_path / "other-tok"
    stdlib_bpe(300).save_pretrained(other)
    bare = _variant(ckpt, tmp_path, "no-tokenizer", weights=True)
    (bare / "tokenizer.json").unlink()
    for path, shard_dir in ((ckpt, other), (bare, None), (bare, ckpt)):
        line = problem(_result(0.95), 0.8, path, shard_dir)
        assert f"shard with its own tokenizer (data.tokenizer={path})" in line, line
        assert "above 0.95" not in line
