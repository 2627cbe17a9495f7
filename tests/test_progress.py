"""Progress of a training run in the stage's own log (issue 28): rank 0's progress lines — step/total, loss, val loss,
tokens/s, ETA — and what its long waits wait for (the process group, a checkpoint, the HF export), relayed by the
launcher from the rank's log into the stage's log (from there Airflow's task log and `make run`'s screen)."""

from __future__ import annotations

import json
import logging
import re

from tests.helpers.train_fixture import configure, context, shards  # noqa: F401


def test_train_stage_relays_rank_0_progress_and_waits_and_streams_its_metrics(
    cfg, tmp_path, shards, caplog, monkeypatch
):
    import mlflow

    from tasks import tracking
    from tasks.stages import train

    caplog.set_level(logging.INFO, logger="tasks.progress")
    one = {"parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 1}
    c = configure(cfg, **one, **{"train.steps": 4, "train.log_every": 2, "train.checkpoint_every": 2})
    c.tracking.enabled = True
    client = mlflow.MlflowClient(c.tracking.uri)
    ctx = context(tmp_path, shards, no_export=False)
    ctx.mlflow_run_id = client.create_run(client.create_experiment(f"stream-{tmp_path.name}")).info.run_id
    # the stage-end backfill off: every step MLflow holds was streamed while the rank trained (stream_metrics)
    monkeypatch.setattr(tracking, "settle_metrics", lambda *a, **k: None)
    train.run(c, ctx)
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(ctx.mlflow_run_id, tracking.metric_key("loss"))
    assert sorted((m.step, m.value) for m in history) == list(enumerate(losses, 1)), history
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.progress"]
    steps = [line for line in lines if line.startswith("progress: train step ")]
    # the first step, every log_every steps, the last; val loss from step 1 (eval every step: 4 // 10 < 1)
    assert [int(re.match(r"progress: train step (\d+)/4 ", s)[1]) for s in steps] == [1, 3, 4], lines
    figures = r", loss \d+\.\d{3}, val loss \d+\.\d{3}, [\d.]+k? tokens/s"
    assert re.fullmatch(rf"progress: train step 3/4 \(75%\){figures}, ETA \d+s", steps[1]), steps[1]
    assert re.fullmatch(rf"progress: train step 4/4 \(100%\){figures}, done", steps[2]), steps[2]
    for what in (r"the process group \(1 ranks\)", "checkpoint step-2", "checkpoint step-4"):
        assert any(re.match(rf"progress: waiting for {what}.*…$", line) for line in lines), (what, lines)
        assert any(re.match(rf"progress: {what}.*: done after \d+s$", line) for line in lines), (what, lines)
    export = [line for line in lines if "HF export of step-4" in line]
    assert export[0].startswith("progress: waiting for the HF export of step-4 to ") and "done after" in export[-1]


def test_shard_stage_reports_each_partition_and_write(tmp_path, caplog):
    from data_prep.build import build_shard_set
    from data_prep.config import ShardConfig
    from tasks.stages import shard

    caplog.set_level(logging.INFO, logger="tasks.progress")
    cfg = ShardConfig(
        inputs=["stdlib"], out_dir=str(tmp_path), max_documents=20, vocab_size=300, seq_len=32, partitions=2,
        shard_size_mb=0.05, tokenize_processes=1, progress=False,
    )  # fmt: skip
    build_shard_set(cfg, report=shard.progress())
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.progress"]
    assert lines[:2] == ["progress: shard tokenize partition 1/2 (50%)", lines[1]], lines
    assert re.fullmatch(r"progress: shard tokenize partition 2/2 \(100%\), done", lines[1]), lines
    writes = [line for line in lines if line.startswith("progress: shard write range ")]
    assert writes[0].startswith("progress: shard write range 1/") and writes[-1].endswith(", done"), lines
