"""A tiny shard set and a tiny trained model for the quantize/evaluate tests, built once per test session.

The model is the debug preset trained for a few dozen steps in-process on the shard set's train split (a trained
model, unlike a random one, has the peaked distributions whose perplexity quantization can actually hurt).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_WORDS = {
    "adj": ["quick", "lazy", "red", "small", "bright", "old", "silent", "brave"],
    "noun": ["fox", "dog", "river", "model", "server", "tensor", "garden", "cat"],
    "verb": ["jumps over", "watches", "feeds", "sorts", "copies", "follows", "builds", "finds"],
}


def _corpus(path: Path, docs: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            sentences = [
                f"the {rng.choice(_WORDS['adj'])} {rng.choice(_WORDS['noun'])} "
                f"{rng.choice(_WORDS['verb'])} the {rng.choice(_WORDS['noun'])}."
                for _ in range(rng.randint(3, 8))
            ]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return path


def shard_set(root: Path, docs: int = 300, seed: int = 0, **tokenizer) -> Path:
    """A small shard set of the grammar corpus under root/data (`tokenizer="…/tokenizer.json"` or `vocab_size=N`)."""
    from data_prep.build import build_shard_set
    from data_prep.config import ShardConfig

    root.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(root / "corpus.jsonl", docs, seed)
    return build_shard_set(
        ShardConfig(
            inputs=[str(corpus)],
            out_dir=str(root / "data"),
            seq_len=64,
            val_fraction=0.2,
            shard_size_mb=0.05,
            tokenize_processes=1,
            progress=False,
            **tokenizer,
        )
    ).shard_dir


def tiny_trained(base: Path, steps: int = 40, vocab_size: int = 257, name: str = "quant-tiny") -> dict:
    """{"shard_dir", "model_dir"} under base/<name>, built on first use (another vocab_size: other data, another
    tokenizer — a retrain on new data)."""
    import torch

    from data_prep.loader import ShardLoader
    from tasks.model.config import get_preset
    from tasks.model.hf_io import save_hf
    from tasks.model.loss import lm_loss
    from tasks.model.transformer import build_model, materialize

    root = base / name
    model_dir = root / "hf"
    if (model_dir / "config.json").is_file():
        return {"shard_dir": Path((root / "shards").read_text()), "model_dir": model_dir}
    root.mkdir(parents=True, exist_ok=True)
    shards = shard_set(root, vocab_size=vocab_size)
    tcfg = get_preset("debug")
    tcfg.vocab_size = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = materialize(build_model(tcfg, "cpu"), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ShardLoader(shards, split="train", batch_size=8, seed=0)
    step = 0
    while step < steps:
        for inputs, targets in loader:
            loss = lm_loss(model(inputs), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                break
    (root / "shards").write_text(str(shards))
    save_hf(model.eval(), model_dir, tokenizer_dir=shards)  # last: its config.json marks the fixture complete
    return {"shard_dir": shards, "model_dir": model_dir}


def with_outlier_channels(model_dir: Path, out: Path, scale: float = 1000.0) -> Path:
    """The same function with INT8-hostile weights: each RMSNorm's first channel divided by `scale` and the matching
    input column of the projections after it multiplied by `scale`. FP outputs are unchanged; per-row INT8 weight
    scales are then set by the outlier column and the other weights lose their precision (the outlier problem that
    SmoothQuant and skip_layers address)."""
    import torch

    from tasks.model.hf_io import load_hf, save_hf

    model = load_hf(model_dir)
    with torch.no_grad():
        for block in model.layers.values():
            for norm, projections in ((block.attention_norm, block.attention), (block.ffn_norm, block.feed_forward)):
                norm.weight[0] /= scale
                for name in ("wq", "wk", "wv", "w1", "w3"):
                    if hasattr(projections, name):
                        getattr(projections, name).weight[:, 0] *= scale
    return save_hf(model, out, tokenizer_dir=model_dir)


def grammar_task(folder: Path, n: int = 40) -> Path:
    """A task YAML in lm-eval's own format (a local JSONL, as lm-eval's task guide writes one) on the fixture corpus'
    grammar: after "the <adjective>" comes a noun, never a verb. The tiny trained model gets most right; a broken
    INT8 model does not — unlike demo-continuation, whose passages this synthetic corpus makes indistinguishable."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        context = (
            f"the {rng.choice(_WORDS['adj'])} {rng.choice(_WORDS['noun'])} {rng.choice(_WORDS['verb'])} "
            f"the {rng.choice(_WORDS['adj'])}"
        )
        choices = [" " + rng.choice(_WORDS["noun"])] + [" " + v for v in rng.sample(_WORDS["verb"], 3)]
        rows.append({"question": context, "choices": choices, "answer": 0})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "grammar.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = folder / "grammar.yaml"
    yaml.write_text(
        "task: grammar\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {folder / 'grammar.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - metric: acc\n"
    )
    return yaml
