"""Parity with transformers: HF → ours → HF, logits equal in fp32 (tiny random models saved locally)."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tasks.errors import StageError  # noqa: E402
from tasks.model import build_model, get_preset, materialize  # noqa: E402
from tasks.model.hf_io import load_hf, save_hf  # noqa: E402
from tests.helpers.models import LLAMA_CONFIG  # noqa: E402

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
CASES = {
    "llama-gqa-untied": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
    ),
    "llama-mha-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-gqa-tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-gqa-untied": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=False)),
}


def _hf_model(config_cls: str, extra):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**SHAPE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases: make them non-zero so the q/k/v bias mapping is really tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_parity(case, tmp_path):
    import transformers

    hf = _hf_model(*CASES[case])
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits

    ours = load_hf(tmp_path / "hf").eval()
    assert ours.config.tie_embeddings == hf.config.tie_word_embeddings
    assert (ours.output.weight is ours.tok_embeddings.weight) == ours.config.tie_embeddings
    with torch.no_grad():
        got = ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    save_hf(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, want, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    hf = _hf_model(*CASES["qwen2-gqa-untied"])
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    tokens = torch.arange(16).view(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "hf")(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    (tmp_path / "hf" / shards[-1]).unlink()
    with pytest.raises(StageError, match=f"missing shard {shards[-1]}"):
        load_hf(tmp_path / "hf")


def test_unsupported_architecture_names_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(StageError) as err:
        load_hf(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: unsupported architecture 'GPT2LMHeadModel' ")
    assert "LlamaForCausalLM, Qwen2ForCausalLM" in str(err.value) and "A model family" in str(err.value)
    # no `architectures` (a hand-written config.json): the model_type decides, as in transformers
    from tasks.shape import TransformerConfig

    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "architectures"}))
    assert TransformerConfig.from_hf_config(tmp_path).family == "llama"


def test_export_with_tokenizer_loads_in_transformers(tmp_path):
    import transformers

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["def f(x): return x + 1\n"] * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"])
    )
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    tcfg = get_preset("debug")
    model = materialize(build_model(tcfg), "cpu", seed=3)
    save_hf(model, tmp_path / "out", tokenizer_dir=tmp_path / "tok", dtype=torch.bfloat16)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = hf_tok("def f(x):")["input_ids"]
    assert ids == tok.encode("def f(x):").ids
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    reloaded = load_hf(tmp_path / "out")
    torch.testing.assert_close(reloaded.tok_embeddings.weight, model.tok_embeddings.weight.bfloat16().float())
    assert hf_tok.eos_token is None  # a bare tokenizer.json says nothing of its EOS
    # From a shard set (the training job exports with the set's tokenizer): its manifest names the EOS.
    (tmp_path / "tok" / "manifest.json").write_text(json.dumps({"eos_token": "<eos>"}))
    save_hf(model, tmp_path / "out2", tokenizer_dir=tmp_path / "tok")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out2")
    assert hf_tok.eos_token == "<eos>" and hf_tok.eos_token_id == tok.token_to_id("<eos>")
    # its id too, in config.json (transformers would default a Llama to eos 2: generate() would not stop at EOS)
    (tmp_path / "tok" / "manifest.json").write_text(json.dumps({"eos_token": "<eos>", "eos_id": 1}))
    save_hf(model, tmp_path / "out3", tokenizer_dir=tmp_path / "tok")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out3")
    assert back.config.eos_token_id == back.generation_config.eos_token_id == tok.token_to_id("<eos>") == 1


def test_export_keeps_the_special_token_ids_of_the_checkpoint_its_tokenizer_came_from(tmp_path):
    """Continued training of a published checkpoint, sharded with its own tokenizer: the export's config.json has
    the checkpoint's bos/eos/pad ids and its generation_config.json (they were dropped: transformers then gave a
    Llama bos 1 / eos 2, and generation no longer stopped at the tokenizer's EOS). The shard set's manifest names
    the tokenizer's source; the training export passes the shard set as tokenizer_dir."""
    import transformers

    from tests.helpers.models import stdlib_bpe

    ckpt = tmp_path / "ckpt"
    fast = stdlib_bpe(300)
    fast.save_pretrained(ckpt)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(fast), bos_token_id=7, eos_token_id=fast.eos_token_id, pad_token_id=5,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt)
    transformers.GenerationConfig(bos_token_id=7, eos_token_id=fast.eos_token_id, max_new_tokens=9).save_pretrained(
        ckpt
    )
    shards = tmp_path / "shards"  # what the shard stage leaves: the tokenizer file and a manifest naming its source
    shards.mkdir()
    (shards / "tokenizer.json").write_bytes((ckpt / "tokenizer.json").read_bytes())
    manifest = {"tokenizer": {"source": str(ckpt / "tokenizer.json")}, "eos_id": fast.eos_token_id}
    (shards / "manifest.json").write_text(json.dumps(manifest))
    model = load_hf(ckpt)
    save_hf(model, tmp_path / "out", tokenizer_dir=shards)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert (back.config.bos_token_id, back.config.eos_token_id, back.config.pad_token_id) == (7, fast.eos_token_id, 5)
    assert back.generation_config.max_new_tokens == 9 and back.generation_config.eos_token_id == fast.eos_token_id


def test_shapes_contradicting_config_fail_in_one_line(tmp_path):
    hf = _hf_model(*CASES["llama-gqa-untied"])
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StageError, match=r"tensors do not match config.json \(size mismatch for layers.0.feed_"):
        load_hf(tmp_path)


def test_export_from_dcp_checkpoint_streams_sharded_files_that_transformers_loads(tmp_path):
    """The training job's export: DCP checkpoint → several safetensors files + index + config, one tensor at a time."""
    import transformers
    import torch.distributed.checkpoint as dcp

    from tasks.model.hf_export import export_from_checkpoint

    hf = _hf_model(*CASES["qwen2-gqa-tied"])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    dcp.save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    out = export_from_checkpoint(tmp_path / "step-1", ours.config, tmp_path / "export", file_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as HF does
    from tasks.fsutil import sha256_file

    manifest = json.loads((out / "llm-pipeline.json").read_text())  # hashed while written, by the writing rank
    assert sorted(manifest["files"]) == sorted(p.name for p in out.iterdir() if p.name != "llm-pipeline.json")
    assert all(manifest["files"][f]["sha256"] == sha256_file(out / f) for f in files)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, atol=1e-4, rtol=1e-4)
    half = export_from_checkpoint(tmp_path / "step-1", ours.config, tmp_path / "bf16", dtype=torch.bfloat16)
    assert (half / "model.safetensors").is_file() and not (tmp_path / ".bf16.tmp").exists()
    assert load_hf(half).layers["1"].attention.wq.bias.equal(ours.layers["1"].attention.wq.bias.bfloat16().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_weights_reads_any_box_of_a_tensor(tmp_path, dtype):
    """What a rank owning rows [a, b) × columns [c, d) of a tensor reads is that box of the checkpoint's tensor."""
    from tasks.model.init import HFWeights

    hf = _hf_model(*CASES["qwen2-gqa-untied"]).to(dtype)
    hf.save_pretrained(tmp_path / "hf")
    source = HFWeights(tmp_path / "hf")
    full = hf.model.layers[1].mlp.down_proj.weight.detach()  # [64, 96]
    for (a, b), (c, d) in [((0, 64), (0, 96)), ((7, 33), (50, 96)), ((63, 64), (0, 1)), ((5, 5), (0, 96))]:
        box = torch.empty(b - a, d - c, dtype=torch.float32)
        source.fill("layers.1.feed_forward.w2.weight", box, tuple(full.shape), (a, c))
        assert torch.equal(box, full[a:b, c:d].float()), ((a, b), (c, d))
    bias = torch.empty(3)
    source.fill("layers.0.attention.wq.bias", bias, (64,), (10,))
    assert torch.equal(bias, hf.model.layers[0].self_attn.q_proj.bias.detach()[10:13].float())


def test_a_model_value_set_over_a_checkpoint_is_honoured_and_said(tmp_path, caplog):
    """`--set model.rope_theta=… model.max_seq_len=…` with model.hf_path changed the published model in silence
    (its step-1 loss moved, the export said the new values). It is still the user's to set — RoPE scaling for a
    longer context is one reason — and now a warning names each value beside the checkpoint's own."""
    import logging

    from tasks.config import load_config
    from tasks.model import from_pipeline
    from tests.helpers.models import stdlib_bpe, tiny_qwen2

    tiny_qwen2(tmp_path / "ckpt", tokenizer=stdlib_bpe(300))
    published = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    caplog.set_level(logging.WARNING, logger="tasks")
    plain = from_pipeline(load_config("ci-tiny", sets=[f"model.hf_path={tmp_path / 'ckpt'}"]))
    ours = lambda: [r for r in caplog.records if r.name == "tasks"]  # noqa: E731
    assert plain.rope_theta == published["rope_parameters"]["rope_theta"] != 12345.0 and not ours()
    sets = [f"model.hf_path={tmp_path / 'ckpt'}", "model.rope_theta=12345", "model.max_seq_len=4096"]
    tcfg = from_pipeline(load_config("ci-tiny", sets=sets))
    assert (tcfg.rope_theta, tcfg.max_seq_len) == (12345.0, 4096)
    [record] = ours()
    assert f"model.rope_theta 12345.0 (its config.json: {plain.rope_theta!r})" in record.message
    assert f"model.max_seq_len 4096 (its config.json: {plain.max_seq_len!r})" in record.message


LLAMA = LLAMA_CONFIG


@pytest.mark.parametrize(
    "setting, said",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),  # Llama 3.1's
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type 'yarn'"),
        # both keys (transformers 5 writes rope_parameters; an older rope_scaling beside it still scales)
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"type": "linear"}},
            "'linear'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias (o_proj bias)"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"head_dim": 32}, "head_dim != hidden_size / heads"),
    ],
)
def test_a_checkpoint_setting_the_model_does_not_compute_is_refused_in_one_line(tmp_path, setting, said):
    """What config.json asks for and the model would silently not compute (a scaled RoPE, another activation, a bias)
    stops the run naming the file and the setting."""
    from tasks.shape import TransformerConfig

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **setting}))
    with pytest.raises(StageError) as e:
        TransformerConfig.from_hf_config(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: LlamaForCausalLM: unsupported setting ")
    assert said in str(e.value) and "\n" not in str(e.value) and "use a checkpoint without it" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert TransformerConfig.from_hf_config(tmp_path).n_heads == 4  # the same file without it loads


def test_a_checkpoint_with_only_pickled_weights_names_the_file_and_the_fix(tmp_path):
    """pytorch_model.bin (never unpickled here): the one line says what is there and how to save safetensors."""
    from tasks.model import load_hf
    from tasks.model.model_dir import safetensors_files

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    for call in (lambda: safetensors_files(tmp_path), lambda: load_hf(tmp_path)):
        with pytest.raises(StageError) as e:
            call()
        msg = str(e.value)
        assert "no model.safetensors" in msg and "pytorch_model.bin" in msg and "save_pretrained" in msg
        assert "\n" not in msg
