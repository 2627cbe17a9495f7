"""Real shapes on 4 gloo ranks, and what each ZeRO stage holds, from the training stage's own per-phase memory peaks.

scale.*: Qwen2-0.5B (published shapes, random weights written by transformers in a subprocess) imported into 4
ranks (dp4, ZeRO-3, fp32), trained 3 steps at seq 128 and exported back to HF by the ranks. Baselines from the same
run: the whole fp32 model's bytes (what one process would hold just for the parameters), each rank's own shard
(parameters it holds; bytes of the files it wrote), and the planner's estimate for exactly this layout. On CPU a
phase's peak is its RSS high-water mark; "held" figures subtract the RSS each rank had before the model existed
(interpreter, torch, gloo); the estimate includes the CPU runtime reserve (tasks.planner.cluster.RESERVE_GB).
scale.qwen2_0_5b.dp2_tp2_glibc_1mb.*: the same import and 3 steps on dp2×tp2 (ZeRO-3 over dp, the tied embedding
one hidden-sharded DTensor), not exported, with glibc's mmap and trim thresholds at 1 MB (GLIBC_1MB, below).

zero.estimate_over_measured.{0,1,2,3}: the demo model on dp 2, one run per stage: the planner's estimate over the
measured training-phase peak held (worst rank).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCALE_STEPS, SCALE_SEQ = 3, 128

_WRITE_HF = """
import sys, torch, transformers
from tasks.model import get_preset
from tasks.model.hf_io import to_hf_config
cfg = {k: v for k, v in to_hf_config(get_preset("qwen2-0.5b")).items() if k not in ("architectures", "dtype",
       "torch_dtype")}
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**cfg), dtype=torch.float32)
model.save_pretrained(sys.argv[1], max_shard_size="600MB")
"""


def _train(tmp: Path, shards: Path, name: str, sets: dict, export: bool) -> Path:
    from tasks.stages import train
    from tasks.config import apply_overrides, load_config
    from tasks.runner import StageContext

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False
    apply_overrides(
        cfg,
        {
            "data.loader_workers": 0,
            "train.checkpoint_every": 0,
            # No validation loss: 16 forward passes of Qwen2-0.5B at every one of the 3 steps tripled the bench's time
            # (≈ 3 min a step on 2 cores) and is not what it measures.
            "train.eval_samples": 0,
            "hardware.device": "cpu",
            "parallel.tp": 1,
            "parallel.pp": 1,
            **sets,
        },
    )
    run_dir = tmp / name
    train.run(
        cfg,
        StageContext(
            run_dir=run_dir,
            stage="train",
            args=argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=not export),
        ),
    )
    return run_dir


def _read(run_dir: Path) -> tuple[dict, dict, dict | None]:
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    spec = json.loads((run_dir / "train" / "launch.json").read_text())
    ex = run_dir / "train" / "export_memory.json"
    return summary, spec, json.loads(ex.read_text()) if ex.is_file() else None


def _layout_figures(summary: dict, spec: dict, prefix: str) -> dict:
    """Training-phase peaks of one run: the worst rank's RSS, over the whole fp32 model, and the estimate over each
    rank's held peak."""
    from tasks.model import get_preset, num_params
    from tasks.stages.train import memory_figures
    from tasks.units import GB

    full = num_params(get_preset("qwen2-0.5b")) * 4
    phases = summary["memory_phases_per_rank"]
    peak = max(ph["train"] for ph in phases)
    held_train = [ph["train"] - ph["base"] for ph in phases]
    figures = memory_figures(summary, None, spec["estimate_bytes"], "cpu")
    return {
        f"{prefix}.peak_rss_gb_per_rank": round(peak / GB, 3),
        f"{prefix}.rss_over_full_model": round(peak / full, 3),
        f"{prefix}.held_over_full_model": round(max(held_train) / full, 3),
        f"{prefix}.estimate_gb": round(spec["estimate_bytes"] / GB, 3),
        f"{prefix}.estimate_over_measured": round(figures["memory.estimate_over_measured"], 3),
        **{
            f"{prefix}.estimate_over_measured.rank{r}": round(spec["estimate_bytes"] / h, 3)
            for r, h in enumerate(held_train)
        },
    }


def _scale(tmp: Path, shards: Path) -> dict:
    ckpt = tmp / "qwen2-0.5b-hf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    subprocess.run([sys.executable, "-c", _WRITE_HF, str(ckpt)], check=True, env=env)  # its memory is freed
    common = {
        "model.hf_path": str(ckpt),
        "data.seq_len": SCALE_SEQ,
        "train.steps": SCALE_STEPS,
        "train.global_batch": 4,
        "train.micro_batch": 1,
        "train.precision": "fp32",
        "parallel.zero": 3,
        "hardware.nproc_per_node": 4,
    }
    run_dir = _train(tmp, shards, "qwen2_0_5b", {**common, "parallel.dp": 4}, export=True)
    summary, spec, export = _read(run_dir)
    phases = summary["memory_phases_per_rank"]
    shard = [r["param_elems"] * 4 for r in summary["sharding_per_rank"]]
    out = {
        **_layout_figures(summary, spec, "scale.qwen2_0_5b"),
        "scale.hf_import_peak_rss_over_shard": round(
            max((ph["init"] - ph["base"]) / s for ph, s in zip(phases, shard)), 3
        ),
        "scale.hf_export_peak_rss_over_shard": round(
            max((r["export"] - r["base"]) / r["written_bytes"] for r in export["per_rank"] if r["written_bytes"]), 3
        ),
    }
    out.update(_dp2_tp2(tmp, shards, common))
    return out


# With glibc's defaults each dp2×tp2 rank grew to 5.8 GB and 4 of them ran out of this 24 GB host: TP splits tensors
# below glibc's mmap threshold and freed heap stays resident. Tensors of 1 MB and up get their own mapping (returned
# when freed) and the heap is trimmed above 1 MB free: the figures are named for that setting.
GLIBC_1MB = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}


def _dp2_tp2(tmp: Path, shards: Path, common: dict) -> dict:
    from tasks.errors import StageError

    prefix = "scale.qwen2_0_5b.dp2_tp2_glibc_1mb"
    saved = {k: os.environ.get(k) for k in GLIBC_1MB}
    os.environ.update(GLIBC_1MB)  # the ranks inherit it through torchrun
    try:  # its failure (e.g. the host's memory taken by other work) must not drop the dp4 figures
        run_dir = _train(
            tmp, shards, "qwen2_0_5b_dp2_tp2", {**common, "parallel.dp": 2, "parallel.tp": 2}, export=False
        )
    except StageError as e:
        return {f"{prefix}.error": str(e)[:300]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    summary, spec, _ = _read(run_dir)
    return _layout_figures(summary, spec, prefix)


def _zero(tmp: Path, shards: Path) -> dict:
    from tasks.stages.train import memory_figures

    out = {}
    for zero in (0, 1, 2, 3):
        run_dir = _train(
            tmp,
            shards,
            f"zero{zero}",
            {
                "model.preset": "demo",
                "data.seq_len": 128,
                "train.steps": 3,
                "train.global_batch": 8,
                "train.micro_batch": 4,
                "train.precision": "fp32",
                "parallel.dp": 2,
                "parallel.zero": zero,
                "hardware.nproc_per_node": 2,
            },
            export=False,
        )
        summary, spec, _ = _read(run_dir)
        out[f"zero.estimate_over_measured.{zero}"] = round(
            memory_figures(summary, None, spec["estimate_bytes"], "cpu")["memory.estimate_over_measured"], 3
        )
    return out


def run() -> dict:
    from data_prep.testing import tiny_shard_set

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tiny_shard_set(tmp / "data", seq_len=128, vocab_size=2048, n_docs=60)
        figures = _zero(tmp, shards)
        figures.update(_scale(tmp, shards))
    return figures


if __name__ == "__main__":
    print(run())
