"""Helpers shared by the training tests: a tiny real shard set, launch specs, the single-process reference (loss,
gradient norm and parameters per step) and the comparison of a run with it."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest

# The debug model on 32-token windows, fp32 (parity), 5 steps of 8 sequences; the validation loss on one global batch
# of the val split after every step (train.steps // 10 < 1): every layout's val.loss is checked with its loss.
BASE = {
    "model.preset": "debug",
    "data.seq_len": 32,
    "data.loader_workers": 0,
    "train.steps": 5,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.precision": "fp32",
    "train.lr": 3e-3,
    "train.min_lr": 3e-4,
    "train.warmup_steps": 2,
    "train.grad_clip": 0.5,
    "train.checkpoint_every": 0,
    "train.eval_samples": 8,
    "hardware.device": "cpu",
    "parallel.zero": 3,
    "parallel.recompute": "none",
}


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """A tiny real shard set (stdlib sources, BPE 512, 32-token windows), built once per session."""
    from data_prep.testing import tiny_shard_set

    return tiny_shard_set(tmp_path_factory.mktemp("train-shards"))


def configure(cfg, **sets):
    """A copy of the test config with BASE and `sets` ({"parallel.dp": 2} or parallel__dp=2) applied."""
    from tasks.config import apply_overrides, validate

    c = copy.deepcopy(cfg)
    c.tracking.enabled = False
    apply_overrides(c, {**BASE, **{k.replace("__", "."): v for k, v in sets.items()}})
    return validate(c)


def context(run_dir: Path, shards: Path, no_export: bool = True):
    from tasks.runner import StageContext

    ns = argparse.Namespace(shard_dir=str(shards), fresh=False, no_export=no_export)
    return StageContext(run_dir=Path(run_dir), stage="train", args=ns)


def write_spec(cfg, run_dir: Path, shards: Path, **extra) -> Path:
    """The stage's own launch spec (train.prepare: all pre-launch checks), written where the stage writes it."""
    from tasks.stages import train
    from tasks.fsutil import atomic_write_json

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {**train.prepare(cfg, context(run_dir, shards)), **extra}
    return atomic_write_json(run_dir / "train" / "launch.json", spec)


def torchrun(cfg, nproc: int, specs: list[Path], log: Path, env_extra: dict | None = None):
    """One real torchrun launch of the worker over several specs; returns (rc, torchrun output)."""
    from tasks.launch import torchrun as launch

    argv = launch.argv(cfg, nproc, specs, rdzv_id="test", backend="cpu")
    env = launch.env(cfg, "cpu", nproc)
    env.update(env_extra or {})
    return launch.run(argv, env, log)


# Plain SGD without clipping, momentum, weight decay or LR schedule: each step's update is −lr × the gradient, so a
# wrong gradient scale (a missing 1/dp, 1/ep, a double count) shows in the update and in the gradient norm, where
# AdamW and clipping normalise it away. A checkpoint every step gives the parameters after each step.
SGD = {
    "train.optimizer": "sgd",
    "train.lr": 0.05,
    "train.min_lr": 0.05,
    "train.warmup_steps": 0,
    "train.weight_decay": 0.0,
    "train.grad_clip": 0.0,
    "train.steps": 3,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 3,
}


def fake_run(cfg, run: Path, shards: Path, step: int, digest: bool = True, with_metrics: bool = True) -> Path:
    """A run directory whose newest checkpoint step-`step` was saved by `cfg` on `shards` (meta.json as the trainer
    writes it, no tensors) with its metrics (unless not `with_metrics`); returns the checkpoint."""
    from data_prep.manifest import digest as manifest_digest
    from tasks.model.model_dir import shard_tokenizer
    from tasks.parallel.checkpoint import shaping_config
    from tasks.stages import train

    spec = train.prepare(cfg, context(run, shards))  # no checkpoint yet: the model shape the stage computes
    path = run / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    meta = {
        "step": step,
        "model": spec["model"],
        "shaping": shaping_config(cfg.to_dict()),
        "tokenizer": shard_tokenizer(shards),
        **({"manifest_digest": manifest_digest(shards)} if digest else {}),
    }
    (path / "meta.json").write_text(json.dumps(meta))
    if with_metrics:
        (run / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "loss": 6.0 - s / 10, "tokens_per_s": 100.0}) + "\n" for s in range(1, step + 1)
            )
        )
    return path


def metrics(run_dir: Path) -> dict[int, dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def losses(run_dir: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in metrics(run_dir).items()}


def val_slice(cfg, shards: Path) -> list:
    """The validation slice as one plain process sees it: train.eval_samples rounded up to whole global batches of
    the val split in its stored order, one (inputs, targets) per global batch."""
    import math

    from data_prep.loader import ShardLoader

    t = cfg.train
    if not t.eval_samples:
        return []
    stream = iter(ShardLoader(shards, "val", batch_size=t.global_batch, num_workers=0, shuffle=False))
    return [next(stream) for _ in range(math.ceil(t.eval_samples / t.global_batch))]


def val_steps(cfg, steps) -> set[int]:
    """The steps the trainer evaluates at: every train.eval_every (0: train.steps // 10, at least 1) and the last."""
    every = cfg.train.eval_every or max(1, cfg.train.steps // 10)
    return {s for s in steps if s % every == 0 or s == cfg.train.steps} if cfg.train.eval_samples else set()


def reference_run(cfg, shards: Path, steps: int, params: bool = False) -> dict:
    """One process, one plain model, one loader of the whole global batch: the run every layout must reproduce
    (the loader's global sample order gives every dp degree the same samples per step). Per step: the loss, the
    pre-clip gradient norm and (params=True) the parameters after it, step 0 being the initial ones; at the
    validation steps the mean loss over the validation slice (`val.loss`, forward only). With model.hf_path the
    weights start from that checkpoint, as the trainer's do; model.converters apply as the trainer applies them."""
    import torch

    from data_prep.loader import ShardLoader
    from data_prep.manifest import load_manifest
    from tasks.model import build_model, converters, from_pipeline, lm_loss, materialize
    from tasks.model.init import HFWeights
    from tasks.parallel.optim import build_optimizers, grad_norm_and_clip

    t = cfg.train
    tcfg = from_pipeline(cfg, vocab_size=load_manifest(shards)["vocab_size"])
    source = HFWeights(cfg.model.hf_path, tcfg) if cfg.model.hf_path else None
    model = build_model(tcfg, "meta")
    converters.apply(model, converters.build(cfg.model.converters, converters.ConvertContext("cpu", tcfg, cfg)))
    model = materialize(model, "cpu", t.seed, source=source)  # the trainer's order: meta → converters → weights
    [(opt, sched)] = build_optimizers([model], t)
    stream = ShardLoader(shards, "train", batch_size=t.global_batch, num_workers=0, seed=t.seed).batches()

    def snapshot():
        return {n: p.detach().clone() for n, p in model.state_dict().items()}

    val, evals = val_slice(cfg, shards), val_steps(cfg, range(1, steps + 1))
    out = {"loss": {}, "grad_norm": {}, "params": {0: snapshot()} if params else {}, "val.loss": {}}
    for step in range(1, steps + 1):
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        loss.backward()
        out["grad_norm"][step] = grad_norm_and_clip(list(model.parameters()), t.grad_clip).item()
        opt.step()
        sched.step()
        opt.zero_grad()
        out["loss"][step] = loss.item()
        if params:
            out["params"][step] = snapshot()
        if step in evals:
            with torch.no_grad():
                out["val.loss"][step] = sum(lm_loss(model(x), y).item() for x, y in val) / len(val)
    return out


def reference_losses(cfg, shards: Path, steps: int) -> dict[int, float]:
    return reference_run(cfg, shards, steps)["loss"]


def checkpoint_params(ckpt: Path) -> dict:
    """The model's tensors in a DCP checkpoint, read into plain tensors in this process (no process group)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model = {
        k.removeprefix("model."): torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "torch.distributed is … uninitialized": one process is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=str(ckpt), no_dist=True)
    return model


def assert_same_curve(got: dict[int, float], want: dict[int, float], what: str, rel: float = 1e-4, steps=None) -> None:
    """Every step the run should have logged (default 1..BASE's train.steps) equals the reference curve."""
    steps = list(steps) if steps is not None else list(range(1, BASE["train.steps"] + 1))
    assert sorted(got) == steps, f"{what}: logged steps {sorted(got)} != {steps}"
    for step, loss in got.items():
        assert abs(loss - want[step]) <= rel * abs(want[step]), f"{what} step {step}: {loss} vs {want[step]}"


def assert_same_run(
    run_dir: Path,
    ref: dict,
    what: str,
    rel: float = 1e-4,
    steps=None,
    updates: bool = False,
    norm_rel=None,
    val_rel=None,
    update_steps=None,
):
    """Per step: the loss of the run equals the reference's within `rel`, the pre-clip gradient norm within
    `norm_rel` (default rel / 10: a norm's float32 sums agree to ~1e-7 across layouts; a small term counted wrong —
    the norms' weights under TP, 3e-5 of the norm — must show); the val.loss at the reference's validation steps
    within `val_rel` (default rel); with `updates`, each parameter's update of each
    step (from the checkpoint of every step; step 0 = the reference's initial weights, bit-identical on every
    layout) within `rel` of its norm — at `update_steps` (default every step)."""
    got = metrics(run_dir)
    assert_same_curve({s: r["loss"] for s, r in got.items()}, ref["loss"], what, rel, steps)
    val_rel = rel if val_rel is None else val_rel
    for step, r in got.items():  # the validation loss: at the same steps, the same value
        want = ref["val.loss"].get(step)
        assert ("val.loss" in r) == (want is not None), f"{what} step {step}: val.loss {r.get('val.loss')} vs {want}"
        if want is not None:
            assert abs(r["val.loss"] - want) <= val_rel * want, (
                f"{what} step {step}: val.loss {r['val.loss']} vs {want}"
            )
    norm_rel = rel / 10 if norm_rel is None else norm_rel
    for step, r in got.items():
        want = ref["grad_norm"][step]
        assert abs(r["grad_norm"] - want) <= norm_rel * want, (
            f"{what} step {step}: grad norm {r['grad_norm']} vs {want}"
        )
    if not updates:
        return
    before = ref["params"][0]
    for step in sorted(got) if update_steps is None else update_steps:
        after = checkpoint_params(Path(run_dir) / "checkpoints" / f"step-{step}")
        assert set(after) == set(before), f"{what} step {step}: parameters {sorted(set(after) ^ set(before))}"
        for name, p in after.items():
            delta, want = p - before[name], ref["params"][step][name] - ref["params"][step - 1][name]
            err, scale = (delta - want).norm().item(), want.norm().item()
            assert err <= rel * scale + 1e-12, f"{what} step {step}: update of {name} off by {err:.3g} of {scale:.3g}"
        before = after
