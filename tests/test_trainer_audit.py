"""Trainer audit: a train.micro_batch that does not divide each dp rank's batch is refused before launch (never run
as another size), and a checkpoint without tokenizer.json says that its tokenizer was not checked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tasks.errors import ConfigError
from tasks.layout import Layout, batch_problems, resolve
from tests.helpers.train_fixture import configure, context, shards  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "lay, expected",
    [
        (  # 6 per rank in micro-batches of 4: was one micro-batch of 6
            Layout(dp=2, global_batch=12, micro_batch=4),
            "train.micro_batch: 4 does not divide the 6 sequences per dp rank (train.global_batch 12 / "
            "parallel.dp 2); set it to one that does (1, 2, 3, 6), or train.global_batch to a multiple of 8",
        ),
        (  # larger than the rank's batch: was one micro-batch of 2
            Layout(dp=4, global_batch=8, micro_batch=4),
            "train.micro_batch: 4 does not divide the 2 sequences per dp rank (train.global_batch 8 / "
            "parallel.dp 4); set it to one that does (1, 2), or train.global_batch to a multiple of 16",
        ),
        (
            Layout(dp=1, global_batch=8, micro_batch=2, microbatches=3),
            "parallel.microbatches: 3 does not divide the 8 sequences per dp rank (train.global_batch 8 / "
            "parallel.dp 1); set it to one that does (1, 2, 4, 8), or 0 (train.micro_batch sets it)",
        ),
    ],
)
def test_a_batch_that_does_not_split_evenly_is_refused_in_one_line(lay, expected):
    assert batch_problems(lay) == [expected]


def test_the_sizes_named_stay_short_for_a_large_batch():
    [problem] = batch_problems(Layout(dp=1, global_batch=720, micro_batch=7))
    assert "(1, 2, 3, 4, …, 240, 360, 720)" in problem


@pytest.mark.parametrize(
    "lay",
    [
        Layout(dp=2, global_batch=12, micro_batch=3),
        Layout(dp=2, global_batch=12, micro_batch=6),
        # parallel.microbatches set: it splits the rank's batch, train.micro_batch is that split's size (one that is
        # not: tests/test_silent_config_leftovers.py)
        Layout(dp=1, global_batch=8, micro_batch=2, microbatches=4),
    ],
)
def test_a_batch_that_splits_evenly_passes(lay):
    assert batch_problems(lay) == []


def test_every_preset_splits_its_batch():
    from tasks.config import load_config

    presets = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert presets
    for name in presets:
        cfg = load_config(name)
        hw, par = cfg.hardware, cfg.parallel
        world = par.dp * par.tp * par.pp or hw.nnodes * hw.nproc_per_node
        assert batch_problems(resolve(cfg, None, world)) == [], name


def test_a_micro_batch_that_does_not_divide_is_refused_before_launch(cfg, tmp_path, shards):
    from tasks.stages import train

    c = configure(
        cfg,
        **{
            "parallel.dp": 2,
            "parallel.tp": 1,
            "parallel.pp": 1,
            "hardware.nproc_per_node": 2,
            "train.global_batch": 12,
            "train.micro_batch": 4,
        },
    )
    with pytest.raises(ConfigError) as err:
        train.prepare(c, context(tmp_path, shards))
    assert err.value.problems == [
        "train.micro_batch: 4 does not divide the 6 sequences per dp rank (train.global_batch 12 / parallel.dp 2); "
        "set it to one that does (1, 2, 3, 6), or train.global_batch to a multiple of 8"
    ]
    assert not (tmp_path / "logs").exists()  # no worker was started


def test_a_checkpoint_without_tokenizer_json_says_its_tokenizer_was_not_checked(tmp_path, shards, caplog):
    from tasks.model.hf_io import tokenizer_problem
    from tests.helpers.models import stdlib_bpe, tiny_qwen2

    caplog.set_level(logging.WARNING, logger="tasks")
    bare = tmp_path / "bare"
    tiny_qwen2(bare, vocab=512)  # saved by transformers, weights and config.json only
    assert not (bare / "tokenizer.json").exists()
    assert tokenizer_problem(bare, shards) is None  # nothing to compare with: not refused…
    [warning] = [r for r in caplog.records if r.name == "tasks" and r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "\n" not in message
    assert message.startswith(f"model.hf_path {bare}: has no tokenizer.json, so whether the shard set {shards}")
    assert "was not checked" in message and f"copy its tokenizer.json into {bare}" in message  # …but said, with fix

    caplog.clear()  # with its own tokenizer.json the check runs: another tokenizer than the shard set's is refused
    own = tmp_path / "own"
    tiny_qwen2(own, tokenizer=stdlib_bpe())
    assert "is not the shard set's" in tokenizer_problem(own, shards)
    assert not [r for r in caplog.records if r.name == "tasks"]
