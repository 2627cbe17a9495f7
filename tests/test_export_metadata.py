"""The training export's config.json special token ids and generation_config.json come from model.hf_path (the
checkpoint the training started from), not from the checkpoint a cached shard set's manifest names as its
tokenizer's source: two checkpoints with identical tokenizer bytes share one shard set."""

from __future__ import annotations

import json

import pytest


def _checkpoint(path, fast, eos, generation: dict, **settings):
    """A tiny Llama saved by transformers with `fast` (the same tokenizer bytes in every checkpoint) beside it."""
    import torch
    import transformers

    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(fast), max_position_embeddings=128, bos_token_id=7, eos_token_id=eos, pad_token_id=5, **settings,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(generation))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """llama-gqa and llama-gen (identical tokenizer and weights; llama-gen has eos [eos, 2], its own sampling
    generation_config.json, attention dropout 0.1 and initializer_range 0.05); a shard set built first from llama-gqa's
    tokenizer; a DCP checkpoint of the model."""
    import torch.distributed.checkpoint as dcp

    from tasks.model.hf_io import load_hf
    from tests.helpers.models import stdlib_bpe

    root = tmp_path_factory.mktemp("export_metadata")
    fast = stdlib_bpe(300)
    eos = fast.eos_token_id
    gqa, gen = root / "llama-gqa", root / "llama-gen"
    _checkpoint(gqa, fast, eos, {"bos_token_id": 7, "eos_token_id": eos, "max_new_tokens": 9})
    _checkpoint(
        gen,
        fast,
        [eos, 2],
        {"eos_token_id": [eos, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64},
        attention_dropout=0.1,
        initializer_range=0.05,
    )
    assert (gqa / "tokenizer.json").read_bytes() == (gen / "tokenizer.json").read_bytes()
    shards = root / "shards"  # the cached shard set: its manifest names the checkpoint that first built it
    shards.mkdir()
    (shards / "tokenizer.json").write_bytes((gqa / "tokenizer.json").read_bytes())
    manifest = {"tokenizer": {"source": str(gqa / "tokenizer.json")}, "eos_id": eos}
    (shards / "manifest.json").write_text(json.dumps(manifest))
    bare = root / "bare"  # a tokenizer directory with neither config.json nor a manifest naming a source
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((gqa / "tokenizer.json").read_bytes())
    model = load_hf(gqa)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "step-1"), no_dist=True)
    return {"root": root, "gqa": gqa, "gen": gen, "shards": shards, "bare": bare, "eos": eos, "tcfg": model.config}


def _export(c, name, tokenizer_dir, hf_path):
    from tasks.model.hf_export import export_from_checkpoint

    out = export_from_checkpoint(
        c["root"] / "step-1", c["tcfg"], c["root"] / name, tokenizer_dir=tokenizer_dir, hf_path=hf_path
    )
    return json.loads((out / "config.json").read_text()), json.loads((out / "generation_config.json").read_text())


def test_export_takes_ids_and_generation_config_from_hf_path_not_the_shard_sets_source(two_checkpoints):
    import transformers

    c = two_checkpoints
    config, generation = _export(c, "hf", c["shards"], c["gen"])
    assert config["eos_token_id"] == [c["eos"], 2] and (config["bos_token_id"], config["pad_token_id"]) == (7, 5)
    assert generation == json.loads((c["gen"] / "generation_config.json").read_text())
    assert (config["attention_dropout"], config["initializer_range"]) == (0.1, 0.05)  # hf_path's, not the defaults
    back = transformers.AutoModelForCausalLM.from_pretrained(c["root"] / "hf")
    assert back.config.eos_token_id == back.generation_config.eos_token_id == [c["eos"], 2]
    g = back.generation_config
    assert (g.do_sample, g.temperature, g.top_p, g.max_new_tokens) == (True, 0.6, 0.9, 64)


def test_export_with_a_bare_tokenizer_dir_still_carries_hf_paths_ids_and_generation_config(two_checkpoints):
    c = two_checkpoints
    config, generation = _export(c, "hf-bare", c["bare"], c["gen"])
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (7, [c["eos"], 2], 5)
    assert generation["max_new_tokens"] == 64 and generation["do_sample"] is True


def test_export_without_hf_path_keeps_the_tokenizer_sources_metadata(two_checkpoints):
    c = two_checkpoints
    config, generation = _export(c, "hf-no-path", c["shards"], None)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (7, c["eos"], 5)
    assert generation == json.loads((c["gqa"] / "generation_config.json").read_text())
    assert "attention_dropout" not in config  # no hf_path: nothing of llama-gen's carried


def test_a_null_or_absent_bos_is_not_replaced_by_transformers_default(tmp_path):
    """A source config.json whose bos_token_id is null, and a shard set's tokenizer (EOS only): the export says null,
    so transformers does not load LlamaConfig's BOS 1 (a token of this vocabulary) in its place."""
    import transformers

    from tasks.model.hf_io import special_tokens

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": 3}))
    shard_set = tmp_path / "shards"
    shard_set.mkdir()
    (shard_set / "manifest.json").write_text(json.dumps({"eos_id": 3}))
    for ids in (special_tokens(None, source)[0], special_tokens(shard_set)[0]):
        assert ids["bos_token_id"] is None and ids["eos_token_id"] == 3, ids
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", **ids}))
        assert transformers.AutoConfig.from_pretrained(out).bos_token_id is None
