"""The smoke stage on a derived sibling against the same stage on the full model, in the same run.

The full model is Qwen2-0.5B's shape with the shard set's vocabulary (the largest preset a CPU host can still smoke
whole: ~0.36B parameters, ~6 GB of FP32 AdamW state); the sibling is what `smoke.model=auto` derives for it when one
device has `SIBLING_DEVICE_GB` (tasks/model/sibling.py). Both run the smoke's own FP32 curve (tasks.stages.smoke
.run_curve: the same batches, optimizer and step) for STEPS steps; the figures are the wall-clock ratio
sibling / full (`smoke.sibling_time_over_full`), the parameter ratio, and each curve's loss drop (the sibling must
still show the loss falling: a sibling that learns nothing would be a cheaper but useless smoke).

Heavy (the full model's steps take tens of seconds each on 2 cores): run it alone, `python bench/run_all.py
smoke_sibling`, not on a shared machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FULL, SIBLING_DEVICE_GB, SEQ, VOCAB, STEPS = "qwen2-0.5b", 1.0, 128, 2048, 10


def _timed_curve(tcfg, batches, cfg) -> tuple[float, list]:
    import torch

    from tasks.model import build_model, materialize
    from tasks.stages.smoke import run_curve

    state = materialize(build_model(tcfg), "cpu", cfg.train.seed).state_dict()
    start = time.perf_counter()
    curve = run_curve("fp32", tcfg, state, batches, torch.device("cpu"), cfg, fp32_clean=False)
    return time.perf_counter() - start, curve.losses


def run() -> dict:
    from data_prep.testing import tiny_shard_set
    from tasks.config import load_config
    from tasks.model import from_pipeline, num_params
    from tasks.model.sibling import choose
    from tasks.stages.smoke import load_batches

    cfg = load_config(
        "demo-cpu",
        sets=[f"model.preset={FULL}", f"model.vocab_size={VOCAB}", f"data.seq_len={SEQ}", "tracking.enabled=false"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        shards = tiny_shard_set(Path(tmp) / "s", seq_len=SEQ, vocab_size=VOCAB, n_docs=200)
        batches = load_batches(shards, STEPS, cfg.smoke.micro_batch, cfg.train.seed)
    full = from_pipeline(cfg, vocab_size=VOCAB)
    cfg.hardware.device_memory_gb = SIBLING_DEVICE_GB
    sib, info = choose(cfg, full, VOCAB, SEQ)
    t_sib, l_sib = _timed_curve(sib, batches, cfg)
    t_full, l_full = _timed_curve(full, batches, cfg)

    def drop(losses):
        k = 3
        return round((sum(losses[:k]) - sum(losses[-k:])) / sum(losses[:k]), 4)

    return {
        "smoke.sibling_time_over_full": round(t_sib / t_full, 4),
        "smoke.sibling_params_over_full": round(num_params(sib) / num_params(full), 4),
        "smoke.sibling_of": f"{FULL} (vocab {VOCAB}) on a {SIBLING_DEVICE_GB:g} GB device: {info['layers']} layers, "
        f"hidden {info['hidden']}",
        "smoke.full_s_per_step": round(t_full / STEPS, 3),
        "smoke.sibling_s_per_step": round(t_sib / STEPS, 3),
        "smoke.full_loss_drop": drop(l_full),
        "smoke.sibling_loss_drop": drop(l_sib),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
