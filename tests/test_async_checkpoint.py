"""Checkpoints written in the background (train.async_checkpoint, tasks/parallel/checkpoint.py save_async): a rank
killed while its save is in flight leaves no step-N that a rerun would trust; the rerun (synchronous saves) trains
the uninterrupted curve and both kinds of save write the same verified layout."""

from __future__ import annotations

import pytest

from tasks.errors import StageError
from tests.helpers.train_fixture import assert_same_curve, configure, context, losses, reference_losses, shards  # noqa: F401


@pytest.mark.slow
def test_rank_killed_during_async_save_leaves_no_trusted_checkpoint(cfg, tmp_path, shards, monkeypatch):
    from tasks.parallel.checkpoint import complete_checkpoints, latest_verified, read_meta, verify
    from tasks.stages import train

    dims = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2}
    c = configure(cfg, **dims, **{"train.steps": 4, "train.checkpoint_every": 2})
    assert c.train.async_checkpoint  # the default
    run_dir = tmp_path / "run"
    # rank 1 dies in the background thread writing step-2 (its files written, not yet complete) while training
    # goes on in the foreground
    monkeypatch.setenv("LLM_PIPELINE_FAULT", "1:2:ckpt")
    with pytest.raises(StageError) as err:
        train.run(c, context(run_dir, shards))
    # torch elastic's agent SIGTERMs rank 0 after rank 1's death and may then read rank 0's error file while @record
    # is still writing it: the agent fails on its own JSONDecodeError ("Failed to parse reply file") and prints no
    # end-of-run report, so the rank's signal cannot be named (seen once in 4 full runs; tasks.parallel.rank_errors)
    raced = "Failed to parse reply file" in (run_dir / "logs" / "torchrun.log").read_text()
    expected = (
        "torchrun's elastic agent crashed reading local rank 0's error file"
        if raced
        else "rank 1 died (killed by SIGKILL)"
    )
    assert err.value.retryable and expected in str(err.value)
    assert "killed while writing step-2.tmp" in (run_dir / "logs" / "rank-1.log").read_text()
    assert complete_checkpoints(run_dir / "checkpoints") == []  # step-2.tmp at most, which nothing trusts
    assert latest_verified(run_dir / "checkpoints") == (None, [])

    monkeypatch.delenv("LLM_PIPELINE_FAULT")
    sync = configure(cfg, **dims, **{"train.steps": 4, "train.checkpoint_every": 2, "train.async_checkpoint": False})
    result = train.run(sync, context(run_dir, shards))
    assert "resumed from" not in (run_dir / "logs" / "rank-0.log").read_text()  # nothing to resume from
    assert_same_curve(losses(run_dir), reference_losses(c, shards, 4), "after the killed save", steps=range(1, 5))
    assert result["checkpoint"].endswith("step-4")
    assert [s for s, _ in complete_checkpoints(run_dir / "checkpoints")] == [2, 4]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    for _, path in complete_checkpoints(run_dir / "checkpoints"):
        assert verify(path) is None
        assert {"loader-dp0.json", "rng-rank0.pt", "rng-rank1.pt", ".metadata"} <= set(read_meta(path)["files"])
