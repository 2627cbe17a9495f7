"""The smoke stage on a derived sibling against the same stage on the full model, in the same run.

The full model is Qwen2-0.5B's shape with the shard set's vocabulary (the largest preset a CPU host can still smoke
whole: ~0.36B parameters, ~6 GB of FP32 AdamW state); the sibling is what `smoke.model=auto` derives for it when one
device has `SIBLING_DEVICE_GB` (tasks/model/sibling.py). Both run the smoke's own FP32 curve (tasks.stages.smoke
.run_curve: the same batches, optimizer and step) for STEPS steps; the figures are the wall-clock ratio
sibling / full (`smoke.sibling_time_over_full`), the parameter ratio, and each curve's loss drop (the sibling must
still show the loss falling: a sibling that learns nothing would be a cheaper but useless smoke).

The sibling is chosen by the planner's single-device estimate, so the bench also checks that estimate at real size
without the memory: one FP32 AdamW step of Llama-3-8B (seq 4096, micro-batch 1, what `smoke.model=same` would run)
under FakeTensorMode (tensors with shapes, no storage) and torch's MemTracker (peak bytes by category through
forward, backward and the optimizer step; torch.distributed._tools.mem_tracker), as torchtitan's estimation script
did: `smoke.llama3_8b_estimate_over_tracked` = the estimate over the tracked peak (demo's too, as a small control).

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


def tracked_peak(tcfg, seq: int, micro_batch: int) -> float:
    """Peak bytes MemTracker records for one FP32 AdamW step of `tcfg` on fake tensors (the second of two steps, so
    the optimizer state exists)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from tasks.model.loss import lm_loss
    from tasks.model.transformer import Transformer

    with FakeTensorMode():
        with torch.device("cpu"):
            model = Transformer(tcfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        x = torch.randint(0, tcfg.vocab_size, (micro_batch, seq))
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for _ in range(2):
                tracker.reset_mod_stats()
                lm_loss(model(x), x).backward()
                opt.step()
                opt.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
    return float(sum(dev["Total"] for dev in peak.values()))


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

    from tasks.model import get_preset
    from tasks.planner import estimate_for_run

    tracked = {}
    for preset, seq, mb in (("llama3-8b", 4096, 1), ("demo", SEQ, cfg.smoke.micro_batch)):
        t = get_preset(preset)
        est = estimate_for_run(t, seq, mb, precision="fp32")
        tracked[f"smoke.{preset.replace('-', '_')}_estimate_over_tracked"] = round(est / tracked_peak(t, seq, mb), 3)
    return {
        **tracked,
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
