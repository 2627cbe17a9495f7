"""Hugging Face checkpoints in: directories transformers itself leaves behind that the weight readers must not
misread (a save over an earlier save; a broken index read by smoke's checkpoint check). Tiny models saved locally."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.errors import StageError
from tests.helpers.models import LLAMA_CONFIG, tiny_qwen2

BOTH = "holds both model.safetensors and model.safetensors.index.json"


def _readers(path):
    """Every way a stage reads a checkpoint directory: load_hf (smoke's own weights, quantize, evaluate), train's
    verify, and smoke's first-loss check (which reads the weights box by box without load_hf)."""
    from tasks.model import checkpoint_check
    from tasks.model.hf_io import load_hf
    from tasks.model.model_dir import verify
    from tasks.shape import TransformerConfig

    tokens = torch.arange(8).view(1, 8)
    return {
        "load_hf": lambda: load_hf(path),
        "verify": lambda: verify(path),
        "initial_loss": lambda: checkpoint_check.initial_loss(
            path, TransformerConfig.from_hf_config(path), tokens, tokens
        ),
    }


@pytest.mark.parametrize("first, second", [("40KB", None), (None, "40KB")])
def test_a_directory_saved_over_an_earlier_save_is_refused_naming_both_files(tmp_path, first, second):
    """transformers' save_pretrained over an earlier save leaves one stale weight file: sharded then single keeps
    the old index (its shards deleted), single then sharded keeps the old model.safetensors — which transformers then
    loads while the index names the new shards. Reading either silently could load other weights than transformers
    does; one line names both files and the fix."""
    model = tiny_qwen2(tmp_path / "hf", vocab=128)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": first} if first else {}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": second} if second else {}))
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    for name, read in _readers(tmp_path / "hf").items():
        with pytest.raises(StageError) as e:
            read()
        msg = str(e.value)
        assert BOTH in msg and "delete the stale one" in msg and "\n" not in msg, (name, msg)
    (tmp_path / "hf" / ("model.safetensors" if second else "model.safetensors.index.json")).unlink()
    torch.testing.assert_close(  # the stale file gone: the second save's weights, as transformers reads them
        _readers(tmp_path / "hf")["load_hf"]()(torch.arange(8).view(1, 8)),
        model(torch.arange(8).view(1, 8)).logits,
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize(
    "index, said",
    [
        ("{not json", "is unreadable (JSONDecodeError"),
        ('{"metadata": {}}', "is unreadable (KeyError: 'weight_map')"),
        ('{"weight_map": ["model.norm.weight"]}', "weight_map is not an object of tensor name"),
    ],
)
def test_a_broken_index_is_one_line_for_every_reader(tmp_path, index, said):
    """smoke's checkpoint check read the index itself (a JSONDecodeError / KeyError traceback where load_hf and
    verify said one line), and a weight_map that is not an object was an AttributeError for all three."""
    model = tiny_qwen2(tmp_path / "hf", vocab=128)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    (tmp_path / "hf" / "model.safetensors").unlink(missing_ok=True)
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(index)
    for name, read in _readers(tmp_path / "hf").items():
        with pytest.raises(StageError) as e:
            read()
        msg = str(e.value)
        assert said in msg and "model.safetensors.index.json" in msg and "\n" not in msg, (name, msg)


def test_the_index_of_a_sharded_transformers_save_still_loads(tmp_path):
    """The checks above refuse only what is broken: a plain sharded save passes all three readers."""
    model = tiny_qwen2(tmp_path / "hf", vocab=128)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    (tmp_path / "hf" / "model.safetensors").unlink(missing_ok=True)
    assert (
        len(set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    )
    readers = _readers(tmp_path / "hf")
    readers["verify"]()
    assert readers["initial_loss"]()["tokens"] == 8
    tokens = torch.arange(8).view(1, 8)
    torch.testing.assert_close(readers["load_hf"]()(tokens), model(tokens).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "text, said",
    [
        ("[1, 2]", "unreadable config (AttributeError"),  # JSON, but not an object
        (json.dumps({**LLAMA_CONFIG, "num_attention_heads": "4"}), "unreadable config (TypeError"),
        (
            json.dumps({**LLAMA_CONFIG, "num_key_value_heads": 3}),
            "not a valid model (num_attention_heads: 4 is not divisible by num_key_value_heads 3)",
        ),
    ],
)
def test_a_bad_config_json_is_named_by_its_file_for_every_reader(tmp_path, text, said):
    """A config.json that is not an object or holds a number as a string was an AttributeError/TypeError traceback;
    num_key_value_heads not dividing num_attention_heads (transformers' own forward fails on it; a Qwen2 config.json
    without the key gets Qwen2Config's 32) said `model.n_heads: 4 is not divisible by model.n_kv_heads 3`, a setting
    the user never made. Now one line names the file and its own keys, for load_hf/verify and the pipeline."""
    from tasks.config import load_config
    from tasks.model import from_pipeline
    from tasks.model.model_dir import verify

    (tmp_path / "config.json").write_text(text)
    readers = (
        lambda: verify(tmp_path),
        lambda: from_pipeline(load_config("ci-tiny", sets=[f"model.hf_path={tmp_path}"])),
    )
    for read in readers:
        with pytest.raises(StageError) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 'config.json'}: {said}") and "fix the checkpoint's config.json" in msg
        assert "model.n_heads" not in msg and "\n" not in msg


@pytest.mark.parametrize(
    "preset, change",
    [
        ("debug", {}),
        ("debug", {"family": "qwen2", "qkv_bias": True, "tie_embeddings": True}),
        ("moe-demo", {"n_layers": 3, "mlp_only_layers": [1]}),
        ("moe-demo", {"decoder_sparse_step": 2}),
    ],
)
def test_the_names_a_checkpoint_may_hold_are_the_models_own(preset, change):
    """hf_config.hf_names (what verify and the checkpoint check accept) = the HF names of the built model's tensors."""
    import dataclasses

    from tasks.model import build_model, get_preset
    from tasks.model.hf_config import hf_names
    from tasks.model.hf_io import hf_tensors

    tcfg = dataclasses.replace(get_preset(preset), vocab_size=64, **change)
    built = {h for n, t in build_model(tcfg, "meta").state_dict().items() for h, _ in hf_tensors(n, t)}
    assert hf_names(tcfg) == built | {"lm_head.weight"}


def _relabel(path, **config):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))


@pytest.mark.parametrize(
    "config, first, more",
    [
        # a Qwen2 checkpoint labelled Llama: its q/k/v biases (6 tensors) were dropped, the logits off by ~0.7
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "model.layers.0.self_attn.k_proj.bias", 5),
        # config.json cut to fewer layers than the weights hold (its layer_types too, which transformers checks
        # against num_hidden_layers): layer 1's 12 tensors dropped
        ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, "model.layers.1.input_layernorm.weight", 11),
    ],
)
def test_weights_its_config_json_does_not_describe_are_refused_not_dropped(tmp_path, config, first, more):
    """HFWeights refused a tensor with no name in our model, but one with a name the config's model lacks (a bias
    that model has not, a layer past num_hidden_layers) was skipped in silence by load_hf, train's init and smoke's
    checkpoint check; transformers loads it too, listing the keys UNEXPECTED. Now one line names the first."""
    tiny_qwen2(tmp_path / "hf", vocab=128, bias_std=0.5)
    _relabel(tmp_path / "hf", **config)
    for name, read in _readers(tmp_path / "hf").items():
        with pytest.raises(StageError) as e:
            read()
        msg = str(e.value)
        assert f"tensor {first!r} (and {more} more) is not part of the model its config.json describes" in msg, name
        assert "fix config.json" in msg and "\n" not in msg


def test_a_tied_config_over_a_distinct_lm_head_is_refused(tmp_path):
    """config.json says tie_word_embeddings true, the file stores its own, different lm_head.weight: transformers keeps
    it untied, this model used the embedding (logits off by up to 1.25, 0 % argmax agreement), trained and exported
    another model without a word. One line now; an lm_head.weight equal to the embedding (some exporters write both)
    is fine."""
    from safetensors.torch import load_file, save_file

    from tasks.model.model_dir import verify
    from tests.helpers.models import tiny_qwen2

    tiny_qwen2(tmp_path / "m", vocab=96, tie_word_embeddings=False)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(StageError) as e:
        verify(tmp_path / "m")
    assert str(e.value) == (
        f"{tmp_path / 'm'}: config.json ties the embeddings (tie_word_embeddings true) but lm_head.weight differs from "
        "model.embed_tokens.weight (transformers then keeps lm_head.weight untied; this model would use the "
        "embedding); set tie_word_embeddings to false in config.json, or use the checkpoint whose weights it describes"
    )
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    verify(tmp_path / "m")  # the same tensor twice: the tie holds, no error
