"""Two config values once silently changed: `--set parallel.microbatches=M train.micro_batch=B` trained micro-batches
of (per-rank batch / M) whatever B was (training, without a plan, kept M and dropped B; the plan refused the pair), and
`data.vocab_size: 256` was accepted while the byte-level BPE trained 257 tokens (the 256 bytes and the end token).
Both are refused in one line now. In-process, function level: the layout check, the config load, the plan stage and
a BPE trained on a few lines."""

from __future__ import annotations

import argparse

import pytest

from tasks.errors import ConfigError, StageError
from tasks.layout import batch_problems, check, resolve
from tasks.runner import run_stage

TINY = "ci-tiny"  # dp 2 pinned, train.global_batch 4: 2 sequences per dp rank, on 2 CPU ranks


def _train_problems(sets, plan: dict | None = None) -> tuple[object, list[str]]:
    """What the train stage's pre-launch check (tasks.layout.resolve, then check) says of TINY with `sets`."""
    from tasks.config import load_config
    from tasks.model import from_pipeline

    cfg = load_config(TINY, sets=list(sets))
    lay = resolve(cfg, plan, 2)
    return lay, check(lay, from_pipeline(cfg, vocab_size=cfg.data.vocab_size), cfg.data.seq_len, 2, "test")


def _plan(tmp_path, sets) -> dict:
    from tasks.config import load_config
    from tasks.stages.plan import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cfg = load_config(TINY, sets=list(sets))
    cfg.tracking.enabled = False
    return run_stage("plan", cfg, tmp_path, args=parser.parse_args([]))


@pytest.mark.parametrize(
    "sets, expected",
    [
        (
            ["parallel.microbatches=2", "train.micro_batch=2"],  # was: 2 micro-batches of 1, the 2 typed dropped
            "train.micro_batch: 2 × parallel.microbatches 2 = 4 ≠ the 2 sequences per dp rank (train.global_batch 4 / "
            "parallel.dp 2); set train.micro_batch 1 or parallel.microbatches 1, or leave one of the two unset",
        ),
        (
            ["train.global_batch=12", "parallel.microbatches=3", "train.micro_batch=4"],  # 4 divides no 6: one fix
            "train.micro_batch: 4 × parallel.microbatches 3 = 12 ≠ the 6 sequences per dp rank (train.global_batch 12 "
            "/ parallel.dp 2); set train.micro_batch 2, or leave one of the two unset",
        ),
    ],
)
def test_micro_batch_and_microbatches_set_and_disagreeing_are_refused_by_training_and_plan(tmp_path, sets, expected):
    lay, problems = _train_problems(sets)
    assert problems == [expected] and batch_problems(lay) == [expected]
    with pytest.raises(StageError, match=r"^parallel\.microbatches: .* micro-batches of train\.micro_batch") as e:
        _plan(tmp_path, sets)  # the plan's verdict is the same (its own line, tasks/stages/plan.py)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "sets, micro_batch, microbatches",
    [
        (["parallel.microbatches=2", "train.micro_batch=1"], 1, 2),  # both set, agreeing
        (["train.global_batch=12", "parallel.microbatches=3", "train.micro_batch=2"], 2, 3),
        (["parallel.microbatches=2"], 1, 2),  # only M: the split's size (1) runs, the preset's micro_batch 2 is unused
        (["train.micro_batch=1"], 1, 2),  # only the micro-batch: M follows from it, as before
        (["parallel.microbatches=1", "train.micro_batch=2"], 2, 1),
    ],
)
def test_agreeing_or_single_values_pass_and_say_the_size_that_runs(tmp_path, sets, micro_batch, microbatches):
    lay, problems = _train_problems(sets)
    assert problems == [] and (lay.micro_batch, lay.n_microbatches) == (micro_batch, microbatches)
    chosen = _plan(tmp_path, sets)["parallel"]
    assert (chosen["micro_batch"], chosen["microbatches"]) == (micro_batch, microbatches)
    lay, problems = _train_problems(sets, {"parallel": chosen})  # training with the plan: the same layout, accepted
    assert problems == [] and (lay.micro_batch, lay.n_microbatches) == (micro_batch, microbatches)


def test_a_planned_dp_with_an_explicit_microbatches_trains_what_the_plan_sized(tmp_path):
    """dp left to the plan, M set: the plan sizes micro-batches of per-rank batch / M; training with that plan (the
    preset's micro_batch not set explicitly) accepts it and runs the same split."""
    sets = ["parallel.dp=0", "parallel.microbatches=2"]
    chosen = _plan(tmp_path, sets)["parallel"]
    lay, problems = _train_problems(sets, {"parallel": chosen})
    assert problems == [], problems
    assert (lay.dp, lay.micro_batch, lay.n_microbatches) == (chosen["dp"], chosen["micro_batch"], 2)


TEXTS = ["hello world, this is a tiny corpus of text", "def f(x): return x + 1", "the quick brown fox"] * 20


def test_the_smallest_vocab_size_is_the_one_the_bpe_trainer_honours():
    """MIN_BPE_VOCAB is the trainer's alphabet and special tokens: below it the trainer still builds that many tokens
    (256 → 257, more than asked); from it up the size asked is the size built (257 → 257, 300 → 300 here, where the
    corpus has the merges; fewer merges than asked is data_prep.layout's warning)."""
    from tokenizers import pre_tokenizers

    from data_prep.config import BPE_BYTE_ALPHABET, MIN_BPE_VOCAB
    from data_prep.tokenizer import train_bpe

    assert len(pre_tokenizers.ByteLevel.alphabet()) == BPE_BYTE_ALPHABET
    assert train_bpe(TEXTS, MIN_BPE_VOCAB - 1).get_vocab_size() == MIN_BPE_VOCAB  # why the bound: not honoured below
    for size in (MIN_BPE_VOCAB, 300):
        assert train_bpe(TEXTS, size).get_vocab_size() == size


def test_a_vocab_size_the_trainer_cannot_honour_is_refused_in_one_line():
    from data_prep.config import MIN_BPE_VOCAB, DataConfig
    from data_prep.errors import DataPrepError
    from tasks.config import load_config

    assert MIN_BPE_VOCAB == 257
    with pytest.raises(ConfigError) as e:
        load_config(TINY, sets=["data.vocab_size=256"])
    assert str(e.value) == "data.vocab_size: 256 must be in [257, 4194304]"
    with pytest.raises(DataPrepError, match=r"^vocab_size: 256 is out of range$"):  # python -m data_prep's own style
        DataConfig.from_dict({"vocab_size": 256})
    assert load_config(TINY, sets=["data.vocab_size=257"]).data.vocab_size == 257
    assert DataConfig.model_json_schema()["properties"]["vocab_size"]["minimum"] == 257  # the DAG form's minimum
