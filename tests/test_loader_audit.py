"""What training reads, tried as a new user would (the loader audit): a split short of one global batch is one line
naming the fix (and the train stage says it before launching any rank); a position saved under another seed says
the stream restarts and how to continue instead; loader/validation settings that would do nothing are said to be
unused (train.eval_every without train.eval_samples, data.prefetch_factor without loader workers)."""

from __future__ import annotations

import json

import pytest

from data_prep.errors import DataPrepError
from data_prep.loader import ShardLoader, batch_problem
from tests.helpers.train_fixture import configure, shards, write_spec  # noqa: F401


def test_a_split_short_of_one_global_batch_names_the_fix(shards):
    manifest = json.loads((shards / "manifest.json").read_text())
    val, n = manifest["splits"]["val"]["samples"], len(manifest["splits"]["val"]["shards"])
    assert batch_problem(manifest, "val", val // 2, 2) is None  # exactly one global batch: enough
    with pytest.raises(DataPrepError) as e:
        ShardLoader(shards, "val", batch_size=val // 2 + 1, dp_rank=1, dp_world=2)
    line = str(e.value)
    assert f"has {n} shard(s) and {val} samples: not one batch of {val // 2 + 1} for each of 2 rank(s)" in line, line
    assert line.endswith("use a smaller batch, or shard more data (a larger corpus or a shorter seq_len)"), line


def test_the_train_stage_refuses_a_train_split_short_of_one_global_batch_before_launch(cfg, tmp_path, shards):
    from tasks.errors import ConfigError

    train = json.loads((shards / "manifest.json").read_text())["splits"]["train"]
    have, n = train["samples"], len(train["shards"])
    big = 1 << (have.bit_length())  # the next power of two above the split: a valid global batch, more than it holds
    c = configure(cfg, **{"parallel.dp": 2, "train.global_batch": big, "train.micro_batch": big // 2})
    with pytest.raises(ConfigError) as e:
        write_spec(c, tmp_path / "run", shards)
    line = str(e.value)
    want = f"split 'train' of {shards.name} has {n} shard(s) and {have} samples: not one batch of {big // 2} for each"
    assert want in line and "lower train.global_batch, or shard more data" in line, line
    assert not (tmp_path / "run" / "train" / "launch.json").exists()


def test_a_position_saved_under_another_seed_says_the_stream_restarts_and_how_to_continue(shards):
    saved = ShardLoader(shards, batch_size=4, seed=3)
    next(iter(saved))
    state = saved.state_dict()
    assert state["samples"] == 4
    fresh = ShardLoader(shards, batch_size=4, seed=5)
    with pytest.raises(DataPrepError) as e:
        fresh.load_state_dict(state)
    assert str(e.value) == (
        "cannot resume the data stream: seed was 3, now 5, another sample order; it restarts at epoch 0 "
        "(use seed 3 to continue where it stopped)"
    )
    assert (fresh.epoch, fresh.samples) == (0, 0)  # nothing of the other order's position was taken
    with pytest.raises(DataPrepError, match=r"version was 'shards-x', now .*use the saved shard set to continue"):
        fresh.load_state_dict({**state, "seed": 5, "version": "shards-x"})


def test_eval_every_without_eval_samples_is_said_unused():
    from types import SimpleNamespace

    from tasks.config import PipelineConfig
    from tasks.train.validation import plan

    t = PipelineConfig().train
    t.eval_samples, t.eval_every = 0, 5
    manifest = {"version": "v", "splits": {"val": {"samples": 100}}}
    got, notes = plan(t, SimpleNamespace(global_batch=8), manifest)
    assert got is None and notes == [
        "train.eval_every 5 is not used: train.eval_samples 0 turns the validation loss off; set train.eval_samples "
        "(e.g. 64) to evaluate, or leave train.eval_every out"
    ], notes
    t.eval_every = 0
    assert plan(t, SimpleNamespace(global_batch=8), manifest) == (None, [])


def test_prefetch_factor_without_loader_workers_is_said_unused(cfg, tmp_path, shards):
    def warnings(run: str, **sets) -> list[str]:
        spec = json.loads(write_spec(configure(cfg, **sets), tmp_path / run, shards).read_text())
        return [w for w in spec["warnings"] if "prefetch_factor" in w]

    assert warnings("r1", **{"data.prefetch_factor": 4}) == [
        "data.prefetch_factor 4 is not used: data.loader_workers 0 reads batches in the training process; set "
        "data.loader_workers (>= 1, or -1) to prefetch, or leave data.prefetch_factor out"
    ]
    assert warnings("r2", **{"data.prefetch_factor": 4, "data.loader_workers": 2}) == []  # the workers prefetch
    assert warnings("r3") == []  # not given: nothing to say


def test_a_resume_compares_only_evaluations_of_the_same_validation_slice(shards, capsys):
    """Early stopping's best val.loss after a resume: an earlier evaluation that scored another slice (eval_samples or
    global_batch changed) is not compared; one logged before val.samples existed counts as before."""
    from types import SimpleNamespace

    import torch

    from tasks.train.validation import Validation

    lay = SimpleNamespace(global_batch=2, local_batch=2, dp=1)
    trainer = SimpleNamespace(
        spec={"shard_dir": str(shards)},
        lay=lay,
        coords={"dp": 0},
        device=torch.device("cpu"),
        rank=0,
        ckpt=SimpleNamespace(pinned=None),
        history=[
            {"step": 1, "loss": 6.0, "val.loss": 5.0},  # before val.samples was logged
            {"step": 2, "loss": 5.0, "val.loss": 1.0, "val.samples": 64},  # another slice: lower, not comparable
            {"step": 4, "loss": 4.0, "val.loss": 3.0, "val.samples": 4},  # this run's slice (2 batches × 2)
        ],
    )
    hook = Validation({"every": 2, "batches": 2}, patience=3)
    hook.on_start(trainer)
    assert hook.samples == 4 and hook.best == (4, 3.0) and trainer.ckpt.pinned == 4, hook.best
    out = capsys.readouterr().out
    assert "1 earlier evaluation(s) (steps 2–2) scored 64 samples, this run scores 4: not compared" in out, out
    metrics = {}
    hook.every = 1
    trainer.cfg = SimpleNamespace(train=SimpleNamespace(steps=10))
    trainer.call = lambda *a: None
    trainer.step_fn = SimpleNamespace(validate=lambda batches: 2.5)
    trainer.parts = []
    hook.after_step(trainer, 5, metrics)
    assert metrics["val.samples"] == 4 and metrics["val.loss"] == 2.5 and hook.best == (5, 2.5), metrics
