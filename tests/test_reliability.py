"""Reliability classes of issue 13, each with real processes: the real cause of a rank failure (torchrun error
files), checkpoint verification and fallback, and the other fault classes (see tests/test_bad_inputs.py for the
broad list of bad inputs)."""
from __future__ import annotations

import json
import shutil

import pytest

from tasks.errors import StageError
from train_fixture import configure, context, shards  # noqa: F401

DP2 = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2}


def _shrunk_vocab(shards, tmp_path, vocab: int = 64):
    """A copy of the shard set whose manifest claims a smaller vocabulary than its token ids use."""
    bad = tmp_path / "shards-small-vocab"
    shutil.copytree(shards, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["vocab_size"] = vocab
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


@pytest.mark.slow
def test_rank_python_exception_is_named_and_not_retried(cfg, tmp_path, shards):
    """Token ids ≥ the vocabulary: every rank raises IndexError in the embedding; the stage names it, no retry."""
    from tasks import train

    c = configure(cfg, **DP2, **{"train.steps": 2})
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path / "run", _shrunk_vocab(shards, tmp_path)))
    msg = str(err.value)
    assert not err.value.retryable, msg
    assert "\n" not in msg
    assert msg.startswith("rank ") and " failed at step 1: IndexError: " in msg, msg
    assert "not retried" in msg and "error file of rank" in msg, msg
    assert list((tmp_path / "run" / "logs").glob("torchelastic-node0/*/attempt_0/*/error.json"))


def test_rank_cause_from_log_and_retry_policy(tmp_path):
    """Without an error file the rank log's exception line (of this launch only) is the cause; a peer's
    "connection closed" and torchrun's SIGTERM of the survivors never hide a rank's own exception or SIGKILL."""
    from tasks.parallel import rank_errors
    from tasks.parallel.diagnosis import explain

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-1.log").write_text("Traceback (most recent call last):\n  File \"x\", line 1\n"
                                     "KeyError: 'stale, from an earlier launch'\n")
    offsets = rank_errors.log_offsets(logs)
    with open(logs / "rank-1.log", "a") as f:
        f.write("Traceback (most recent call last):\n  File \"w.py\", line 9, in setup\n    raise X\n"
                "data_prep.errors.DataPrepError: 3 train shards cannot be split over 4 loader streams\n")
    (logs / "rank-0.log").write_text("Traceback (most recent call last):\n  File \"y\"\n"
                                     "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234\n")
    report = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 5)\n"
              "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 6)\n")
    failures = rank_errors.collect(report, logs, 0, 2, offsets)
    assert [(f.rank, f.exc_type) for f in failures] == [(1, "data_prep.errors.DataPrepError"),
                                                        (0, "RuntimeError")]
    assert failures[1].collective and not failures[1].python_exception
    e = explain(tmp_path / "train", 1, report, [], {}, "checkpoint step-2", failures=failures)
    assert not e.retryable and "rank 1 failed at step ?: data_prep.errors.DataPrepError: 3 train shards" in str(e)

    # A SIGKILLed rank (OOM killer, preemption) with a peer that lost its connection: retryable, names the kill.
    killed = [rank_errors.RankFailure(0, 1, "RuntimeError", "Connection closed by peer", "log"),
              rank_errors.RankFailure(1, -9)]
    e = explain(tmp_path / "train", 1, "", [], {}, "checkpoint step-2", failures=killed)
    assert e.retryable and str(e).startswith("rank 1 died (killed by SIGKILL)")
    # Only collective errors (a network fault): retryable.
    e = explain(tmp_path / "train", 1, "", [], {}, "step 0", failures=killed[:1])
    assert e.retryable and "Connection closed by peer" in str(e)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_newest_verified(cfg, tmp_path, shards, capsys):
    """A truncated shard of the newest checkpoint: the resume skips it (saying so), continues from the one before,
    and the curve equals an uninterrupted run; changed training-shaping config is warned about on resume."""
    from tasks import train
    from tasks.parallel import checkpoint as ckpt
    from train_fixture import assert_same_curve, losses, reference_losses

    c = configure(cfg, **DP2, **{"train.steps": 4, "train.checkpoint_every": 2, "train.keep_checkpoints": 3})
    run = tmp_path / "run"
    train.run(c, context(run, shards))
    step4 = run / "checkpoints" / "step-4"
    assert ckpt.verify(step4) is None and "files" in ckpt.read_meta(step4)
    victim = sorted(step4.glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert "truncated" in ckpt.verify(step4) and ckpt.latest_verified(run / "checkpoints")[0][0] == 2

    c6 = configure(cfg, **DP2, **{"train.steps": 6, "train.checkpoint_every": 2, "train.keep_checkpoints": 3})
    result = train.run(c6, context(run, shards))
    err = capsys.readouterr().err
    assert f"warning: checkpoint step-4: {victim.name} is truncated or altered" in err, err
    assert "resuming from step-2" in err
    assert result["warnings"] and result["steps"] == 6
    assert_same_curve(losses(run), reference_losses(c6, shards, 2, 6), "step-4 corrupt, resumed from 2",
                      steps=range(1, 7))
    assert ckpt.verify(run / "checkpoints" / "step-4") is None  # rewritten by the resumed run

    # The same run directory with another learning rate: the resume warns and names the change.
    spec = train.prepare(configure(cfg, **DP2, **{"train.steps": 8, "train.lr": 1e-3}), context(run, shards))
    assert any("train.lr: 0.003 → 0.001" in w for w in spec["warnings"]), spec["warnings"]
    assert spec["resume_from"].endswith("step-6")
