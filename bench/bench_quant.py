"""INT8 against BF16 and FP32 on a model trained until its validation perplexity has stopped falling fast: the demo
config's shard set (stdlib, 600 documents, BPE 2048, seq 128) and model (demo preset) trained the demo config's 300
steps (global batch 16, lr 3e-3 warm-up 20 → cosine to 3e-4), built here once and cached under bench/.work.

Accuracy goes through the quantize and evaluate stages themselves (torchao on CPU, calibration and evaluation on
disjoint parts of the val split): top-1 accuracy drop (the gate's default metric), perplexity rise and greedy
agreement, INT8 vs BF16. Speed is measured here beside BF16 and FP32 models from the same run, rounds alternating:
prefill (prompt of PROMPT tokens) and KV-cache decode (NEW tokens) at batch 1 and batch 8, each as INT8 tokens/s
over BF16's and over FP32's (> 1: INT8 is faster). The headline is vs BF16: weight-only INT8 computes in BF16, so a
ratio vs FP32 is mostly BF16's own gain.

Headline keys are the pipeline's default method, INT8 weight-only; `quant.w8a8.*` repeats them for int8_dynamic.
Everything runs on one thread (`quant.threads`), as a torchrun CPU rank does: on a shared 2-core host two intra-op
threads measure each other's barrier waits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

WORK = HERE / ".work" / "quant"
PROMPT, NEW, BATCHES = 64, 64, (1, 8)
CURVE_EVERY = 50


def _cfg():
    from tasks.config import load_config

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False  # figures only; the registry path is covered by the tests
    cfg.hardware.device = "cpu"
    cfg.data.out_dir = str(WORK / "data")
    cfg.data.shard_multiple = 1
    return cfg


def _key(cfg) -> str:
    parts = {"data": cfg.to_dict()["data"], "model": cfg.to_dict()["model"], "train": cfg.to_dict()["train"]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def _val_ppl(model, batches) -> float:
    from tasks.quant import metrics

    model.eval()
    ppl = metrics.perplexity(model, batches, "cpu")["ppl"]
    model.train()
    return ppl


def trained_model(cfg) -> tuple[Path, Path, dict]:
    """(hf_dir, shard_dir, training record) — from the cache when its key matches."""
    import torch

    from data_prep.build import build_shard_set
    from data_prep.loader import ShardLoader
    from tasks.model.config import get_preset
    from tasks.model.hf_io import save_hf
    from tasks.model.transformer import build_model, materialize
    from tasks.parallel.optim import lr_factor
    from tasks.quant import inputs
    from tasks.stages.shard import shard_config
    from tasks.train.step import single_process

    root = WORK / _key(cfg)
    record_path = root / "record.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        return root / "hf", Path(record["shard_dir"]), record
    if WORK.exists():
        shutil.rmtree(WORK)  # another key: a stale cache
    shards = build_shard_set(shard_config(cfg)).shard_dir
    t = cfg.train
    tcfg = get_preset(cfg.model.preset)
    tcfg.vocab_size = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    tcfg.max_seq_len = max(tcfg.max_seq_len, cfg.data.seq_len)
    model = materialize(build_model(tcfg, "cpu"), "cpu", seed=t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.lr, t.min_lr))
    train_step = single_process(model, opt, t.grad_clip, scheduler=sched)
    val = inputs.val_batches(shards, 8, 16, "evaluation")
    curve = {0: _val_ppl(model, val)}
    batches = ShardLoader(shards, split="train", batch_size=t.global_batch, seed=t.seed).batches()
    for step, (x, y) in zip(range(1, t.steps + 1), batches):
        train_step(x, y)
        if step % CURVE_EVERY == 0 or step == t.steps:
            curve[step] = _val_ppl(model, val)
            print(f"   train step {step}: val ppl {curve[step]:.2f}", flush=True)
    tmp = Path(tempfile.mkdtemp(dir=WORK))
    save_hf(model.eval(), tmp / "hf", tokenizer_dir=shards)
    record = {"steps": t.steps, "val_ppl_curve": curve, "shard_dir": str(shards)}
    (tmp / "record.json").write_text(json.dumps(record))
    tmp.rename(root)
    return root / "hf", shards, json.loads(record_path.read_text())


def _stages(cfg, run_dir: Path, model_dir: Path, shards: Path) -> dict:
    from tasks.stages import evaluate, quantize
    from tasks.runner import StageContext

    args = argparse.Namespace(model_dir=str(model_dir), shard_dir=str(shards), quant_dir=None)
    q = quantize.run(cfg, StageContext(run_dir=run_dir, stage="quantize", args=args))
    args.quant_dir = q["quant_dir"]
    return evaluate.run(cfg, StageContext(run_dir=run_dir, stage="evaluate", args=args))


def _speed(models: dict, shards: Path) -> dict:
    """{batch: {name: {prefill_s, decode_tokens_per_s}}} — all models in one loop per batch size."""
    from tasks.quant import inputs, metrics

    rows = inputs.val_batches(shards, 1, max(BATCHES), "evaluation")[0][0]
    return {b: metrics.generation_speed(models, rows[:b, :PROMPT], NEW, "cpu", repeats=5, warmup=1) for b in BATCHES}


def run() -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dict(measure(), **{"quant.threads": torch.get_num_threads()})
    finally:
        torch.set_num_threads(threads)


def measure() -> dict:
    import copy

    import torch

    from tasks.model.hf_io import load_hf
    from tasks.quant.artifact import load_quantized

    cfg = _cfg()
    WORK.mkdir(parents=True, exist_ok=True)
    model_dir, shards, record = trained_model(cfg)
    curve = {int(k): v for k, v in record["val_ppl_curve"].items()}
    steps = sorted(curve)
    last, before = curve[steps[-1]], curve[steps[-3]]  # the last 100 steps of 300
    cfg.evaluate.prompts = []
    cfg.evaluate.eval_batches = 16
    cfg.evaluate.max_drop_pct = 100.0  # measure, don't gate
    cfg.quantize.qat_on_fail = False
    out = {
        "quant.model_train_steps": record["steps"],
        "quant.model_val_ppl": round(last, 2),
        "quant.model_val_ppl_fall_last_100_steps_pct": round((before - last) / before * 100, 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        qdirs = {}
        for method, prefix in (("int8_weight_only", "quant."), ("int8_dynamic", "quant.w8a8.")):
            cfg.quantize.method = method
            r = _stages(cfg, tmp / method, model_dir, shards)
            qdirs[prefix] = r["quant_dir"]
            out.update(
                {
                    f"{prefix}size_ratio_vs_bf16": r["size_ratio_vs_bf16"],
                    f"{prefix}accuracy_drop_pct": r["accuracy_drop_pct"],
                    f"{prefix}ppl_drop_pct": r["ppl_drop_pct"],
                    f"{prefix}greedy_agreement": r["greedy_agreement"],
                }
            )
        out["quant.bf16_ppl"], out["quant.bf16_top1_accuracy"] = r["ref_ppl"], r["ref_accuracy"]
        fp32 = load_hf(model_dir).eval()
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
        bf16.init_rope()
        models = {
            "fp32": fp32,
            "bf16": bf16,
            "quant.": load_quantized(qdirs["quant."]),
            "quant.w8a8.": load_quantized(qdirs["quant.w8a8."]),
        }
        speed = _speed(models, shards)
    for b, s in speed.items():
        for what in ("prefill", "decode"):
            tps = {
                n: (b * PROMPT / v["prefill_s"] if what == "prefill" else v["decode_tokens_per_s"])
                for n, v in s.items()
            }
            out[f"quant.bf16_{what}_tokens_per_s.b{b}"] = round(tps["bf16"], 1)
            for prefix in ("quant.", "quant.w8a8."):
                for base in ("bf16", "fp32"):
                    out[f"{prefix}{what}_speed_vs_{base}.b{b}"] = round(tps[prefix] / tps[base], 3)
    return out


if __name__ == "__main__":
    import time

    t0 = time.time()
    print(json.dumps(run(), indent=2), f"\n{time.time() - t0:.1f} s")
