"""Continued training from a pretrained checkpoint with the checkpoint's own tokenizer, end to end through the DAG:
a tiny Qwen2 and its BPE tokenizer, saved by `transformers`, are the shard stage's `data.tokenizer` and train's
`model.hf_path`; the shard set, the starting weights, the HF export, quantize and evaluate all carry them."""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers  # noqa: E402

from test_orchestration import dags_test  # noqa: E402


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiny_checkpoint(path: Path, vocab: int = 384):
    """A byte-level BPE trained on a few local files, wrapped and saved by transformers, beside a tiny random Qwen2
    whose embedding is exactly that vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok.train([str(stdlib / name) for name in ("textwrap.py", "string.py", "bisect.py")], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(fast), max_position_embeddings=128,
                                   tie_word_embeddings=False, eos_token_id=fast.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model, fast


def _nll(model, batches) -> float:
    """Mean next-token NLL of `batches` under a transformers model (fp32)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            logits = model(inputs).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            n += targets.numel()
    return total / n


@pytest.mark.slow
def test_dag_continues_training_a_checkpoint_with_its_own_tokenizer(tmp_path, airflow_db):
    from data_prep.loader import ShardLoader
    from data_prep.manifest import digest
    from tasks.config import load_config
    from tasks.quant import inputs

    ckpt = tmp_path / "ckpt"
    hf, fast = tiny_checkpoint(ckpt)
    conf = {"preset": "ci-tiny", "tokenizer": str(ckpt), "hf_path": str(ckpt), "precision": "fp32", "steps": 4}
    out = dags_test("llm_pipeline", conf, tmp_path, extra_env={"HF_HUB_OFFLINE": "1"}, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    run_dir = next((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    res = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("shard", "train", "quantize", "evaluate")}

    # Shard: the checkpoint's tokenizer, byte for byte, and its vocabulary.
    shard_dir = Path(res["shard"]["shard_dir"])
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["tokenizer"]["source"] == str((ckpt / "tokenizer.json").resolve())
    assert manifest["tokenizer"]["sha256"] == _sha(ckpt / "tokenizer.json") == _sha(shard_dir / "tokenizer.json")
    assert manifest["vocab_size"] == len(fast) == hf.config.vocab_size
    assert manifest["eos_id"] == fast.eos_token_id

    # Train: step 1's loss is the checkpoint's own loss on step 1's global batch (same weights, same tokens).
    tiny = load_config("ci-tiny")
    loader = ShardLoader(shard_dir, "train", batch_size=tiny.train.global_batch, dp_rank=0, dp_world=1,
                         num_workers=0, seed=tiny.train.seed)
    first = next(iter(loader))
    step1 = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert step1["step"] == 1
    assert step1["loss"] == pytest.approx(_nll(hf, [first]), abs=1e-4)
    assert res["train"]["steps"] == 4 and res["train"]["final_loss"] < res["train"]["first_loss"]

    # Export: transformers loads it, with the checkpoint's tokenizer files (not a tokenizer of the project's).
    export = Path(res["train"]["hf_dir"])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # all transformers wrote (no special_tokens_map.json)
        assert _sha(export / name) == _sha(ckpt / name), name
    back = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(export)
    assert back_tok.get_vocab() == fast.get_vocab() and back_tok.eos_token == fast.eos_token
    assert back.config.vocab_size == hf.config.vocab_size
    assert not torch.equal(back.model.layers[0].mlp.down_proj.weight, hf.model.layers[0].mlp.down_proj.weight)

    # Quantize and evaluate: that export, calibrated and measured on the checkpoint tokenizer's shard set.
    meta = json.loads((run_dir / "quantize" / "quant_meta.json").read_text())
    assert meta["model_dir"] == str(export) and meta["data_digest"] == digest(shard_dir)
    assert res["evaluate"]["data_digest"] == digest(shard_dir)
    comparison = json.loads((run_dir / "evaluate" / "comparison.json").read_text())
    batches = inputs.val_batches(shard_dir, tiny.evaluate.eval_batches, tiny.train.micro_batch, "evaluation")
    assert comparison["ptq"]["fp_nll"] == pytest.approx(_nll(back, batches), abs=1e-4)
