"""INT8 vs full precision on a dim-512 model briefly trained on a real shard set, through the quantize and evaluate
stages themselves (torchao on CPU): size on disk vs the same weights in BF16, perplexity drop over the same
validation tokens, and forward latency per token of INT8 vs FP32 measured side by side (alternating rounds).

Headline keys are for the pipeline's default method, INT8 weight-only (int8 weights, BF16 compute);
`quant.w8a8.*` repeats them for int8_dynamic (activations quantized per token at run time, int8 matmuls), whose
extra per-call quantization ops make it the more load-sensitive of the two on a shared CPU. `*_vs_bf16` puts the
latency beside a plain BF16 model: on a CPU with fast BF16 matmuls (AVX512-BF16/AMX) most of the gain over FP32 is
BF16's, and INT8's win is memory.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DIM, LAYERS, HEADS, KV_HEADS, FFN, SEQ, VOCAB, STEPS, BATCH = 512, 4, 8, 4, 1536, 128, 1024, 8, 4


def _trained_model(tmp: Path, shards: Path) -> Path:
    """The bench model: Llama-style, dim 512, trained for a few steps so its distributions are not uniform (a
    longer run does not fit the bench's two minutes on two cores)."""
    import json

    import torch

    from data_prep.loader import ShardLoader
    from tasks.model.config import TransformerConfig
    from tasks.model.hf_io import save_hf
    from tasks.model.loss import lm_loss
    from tasks.model.transformer import build_model, materialize

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    tcfg = TransformerConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, ffn_dim=FFN,
                             vocab_size=vocab, max_seq_len=SEQ)
    model = materialize(build_model(tcfg, "cpu"), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step, (inputs, targets) in zip(range(STEPS), ShardLoader(shards, split="train", batch_size=BATCH, seed=0)):
        loss = lm_loss(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_hf(model.eval(), tmp / "hf", tokenizer_dir=shards)


def _stages(cfg, run_dir: Path, model_dir: Path, shards: Path) -> dict:
    from tasks import evaluate, quantize
    from tasks.runner import StageContext

    args = argparse.Namespace(model_dir=str(model_dir), shard_dir=str(shards), quant_dir=None)
    q = quantize.run(cfg, StageContext(run_dir=run_dir, stage="quantize", args=args))
    args.quant_dir = q["quant_dir"]
    return evaluate.run(cfg, StageContext(run_dir=run_dir, stage="evaluate", args=args))


def run() -> dict:
    from data_prep.testing import tiny_shard_set
    from tasks.config import load_config

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False            # figures only; the registry path is covered by the tests
    cfg.hardware.device = "cpu"
    cfg.evaluate.prompts = []
    cfg.evaluate.eval_batches = 8
    cfg.evaluate.latency_tokens = SEQ
    cfg.evaluate.max_drop_pct = 100.0       # measure, don't gate
    cfg.train.micro_batch = 4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tiny_shard_set(tmp / "data", seq_len=SEQ, vocab_size=VOCAB, n_docs=40, val_fraction=0.1,
                                shard_multiple=1)
        model_dir = _trained_model(tmp, shards)
        out = {}
        for method, prefix in (("int8_weight_only", "quant."), ("int8_dynamic", "quant.w8a8.")):
            cfg.quantize.method = method
            r = _stages(cfg, tmp / method, model_dir, shards)
            out.update({f"{prefix}size_ratio_vs_bf16": r["size_ratio_vs_bf16"],
                        f"{prefix}ppl_drop_pct": r["ppl_drop_pct"],
                        f"{prefix}latency_ratio_vs_fp32": r["latency_ratio_vs_fp32"],
                        f"{prefix}latency_ratio_vs_bf16": r["latency_ratio_vs_bf16"]})
        out["quant.fp_ppl"] = r["fp_ppl"]
    return out


if __name__ == "__main__":
    import json
    import time

    t0 = time.time()
    print(json.dumps(run(), indent=2), f"\n{time.time() - t0:.1f} s")
