"""The rehearsal's memory check on the CPU route: the planner's estimate over what the ranks measured, in one run.

The route is tests/test_real_size_route.py's: ci-tiny with the demo model, 4 gloo ranks, each "device" ROUTE_GB, the
layout left to the planner. The plan stage picks the layout; the train stage runs STEPS steps, all of them the
rehearsal (tasks/train/hooks.py Rehearsal, tasks/planner/rehearsal.py). Figures:

- `rehearsal.estimate_over_measured`: the planner's per-rank peak estimate for that layout (tasks.stages.train
  ._estimate, what the rehearsal judges against) over the largest per-rank measured peak — on CPU what a rank held
  beyond its RSS before the model existed (VmHWM less that base), as rehearsal.json's `estimate_over_measured`.
- `rehearsal.layout`: the layout the planner chose and the rehearsal ran.
- `rehearsal.estimate_gb`, `rehearsal.held_gb_max`, `rehearsal.held_gb_min`: the figures behind the ratio.
- Baseline, same model, ranks, batches and run: `rehearsal.dp4_zero0_estimate_over_measured`, the same ratio with
  the layout pinned to plain data parallel (dp4, ZeRO-0: every rank holds the whole model and optimizer; no
  sharding or tensor-parallel term in the estimate), on a device large enough that it passes.

Tracking is off (in a DAG run rank 0 also holds the MLflow client, ~40 MB more). A ratio below 1 means the ranks
held more than the planner estimated (on CPU the RSS also holds what a device would
not: malloc arenas, CPU autocast's kernels; plan.cpu_tolerance allows 3× the estimate). Heavy for a shared host
(two 4-rank launches): `python bench/run_all.py rehearsal`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUTE_GB, STEPS, SEQ, VOCAB = 0.22, 3, 64, 512
ROUTE = {  # tests/test_real_size_route.py's ROUTE, checkpoints and tracking off, every step rehearsed
    "hardware": {"nproc_per_node": 4, "device_memory_gb": ROUTE_GB},
    "model": {"preset": "demo"},
    "parallel": {},  # the planner chooses
    "train": {"precision": "fp32", "steps": STEPS, "global_batch": 8, "micro_batch": 2, "checkpoint_every": 0},
    "tracking": {"enabled": False},
}


def _rehearse(preset: Path, run_dir: Path, shards: Path, sets: list[str]) -> dict:
    """plan then train in `run_dir`; train/rehearsal.json."""
    from tasks.config import load_config
    from tasks.runner import run_stage

    cfg = load_config(str(preset), sets=[f"train.rehearsal_steps={STEPS}", *sets])
    args = argparse.Namespace(shard_dir=str(shards), fresh=False, no_export=True)
    run_stage("plan", cfg, run_dir, args=args)
    run_stage("train", cfg, run_dir, args=args)
    return json.loads((run_dir / "train" / "rehearsal.json").read_text())


def run() -> dict:
    from data_prep.testing import tiny_shard_set
    from tasks.config import CONFIG_DIR
    from tasks.planner.rehearsal import layout_name
    from tasks.units import GB

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tiny_shard_set(tmp / "shards", seq_len=SEQ, vocab_size=VOCAB, n_docs=150)
        cfg = yaml.safe_load((CONFIG_DIR / "ci-tiny.yaml").read_text())
        for section, values in ROUTE.items():
            cfg[section] = {**cfg.get(section, {}), **values} if values else {}
        preset = tmp / "route.yaml"
        preset.write_text(yaml.safe_dump(cfg))
        route = _rehearse(preset, tmp / "route", shards, [])
        plan = json.loads((tmp / "route" / "plan" / "plan.json").read_text())["chosen"]
        pins = ["parallel.dp=4", "parallel.tp=1", "parallel.pp=1", "parallel.zero=0", "parallel.recompute=none"]
        base = _rehearse(preset, tmp / "dp4", shards, [*pins, "hardware.device_memory_gb=8"])
    return {
        "rehearsal.estimate_over_measured": round(route["estimate_over_measured"], 3),
        "rehearsal.layout": layout_name(plan),
        "rehearsal.estimate_gb": round(route["estimate_bytes"] / GB, 4),
        "rehearsal.held_gb_max": round(max(route["held_per_rank"]) / GB, 4),
        "rehearsal.held_gb_min": round(min(route["held_per_rank"]) / GB, 4),
        "rehearsal.dp4_zero0_estimate_over_measured": round(base["estimate_over_measured"], 3),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
