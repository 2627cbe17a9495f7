"""The launcher's half of the per-step metrics (tasks/parallel/metrics.py MetricsFollower): while the ranks run, the
training stage's own process sends what rank 0 appends to metrics.jsonl to the stage's MLflow run — a real SQLite
store — live, once per record of this launch: not a resumed run's earlier records, all of the file rank 0 rewrites
when it resumes, a line rank 0 is still writing once it is whole."""

from __future__ import annotations

import json
import time

import pytest


def _history(uri: str, run_id: str) -> list[tuple[int, float]]:
    """(step, value) of every train/loss point the run holds, a step sent twice twice."""
    import mlflow

    from tasks.tracking import metric_key

    history = mlflow.MlflowClient(uri).get_metric_history(run_id, metric_key("loss"))
    return sorted((m.step, m.value) for m in history)


def _wait_for(uri: str, run_id: str, steps: list[int], timeout_s: float = 60.0) -> list[tuple[int, float]]:
    deadline = time.monotonic() + timeout_s
    got = _history(uri, run_id)
    while [s for s, _ in got] != steps and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _history(uri, run_id)
    return got


def test_the_follower_sends_this_launchs_records_live_and_once(mlflow_uri, tmp_path):
    import mlflow

    from tasks.parallel.metrics import MetricsFollower, MetricsLog

    client = mlflow.MlflowClient(mlflow_uri)
    run_id = client.create_run(client.create_experiment(f"follower-{tmp_path.name}")).info.run_id
    path = tmp_path / "metrics.jsonl"
    earlier = time.time() - 100  # an earlier launch's steps 1-3 (sent by that launch's follower)
    path.write_text("".join(json.dumps({"step": s, "loss": 9.0 + s, "time": earlier}) + "\n" for s in (1, 2, 3)))

    follower = MetricsFollower(path, mlflow_uri, run_id, poll_s=0.05)
    try:
        deadline = time.monotonic() + 60
        while follower._pos < path.stat().st_size and time.monotonic() < deadline:  # it has read the earlier file
            time.sleep(0.01)
        log = MetricsLog(path, start_step=2)  # rank 0 resumes from step-2: the file rewritten, step 3 redone
        log.log({"step": 3, "loss": 3.5})
        log.log({"step": 4, "loss": 4.5})
        assert _wait_for(mlflow_uri, run_id, [3, 4]) == [(3, 3.5), (4, 4.5)]  # while training runs, not at its end
        line = json.dumps({"step": 5, "loss": 5.5, "time": time.time()}) + "\n"
        with open(path, "a", encoding="utf-8") as f:  # rank 0 mid-line: nothing of it is sent until it is whole
            f.write(line[:10])
            f.flush()
            time.sleep(0.3)
            f.write(line[10:])
        log.log({"step": 6, "loss": 6.5})
        log.close()
    finally:
        follower.close()
    # once each, this launch's values: not the earlier launch's steps, nor its step 3
    assert _history(mlflow_uri, run_id) == [(3, 3.5), (4, 4.5), (5, 5.5), (6, 6.5)]


@pytest.mark.parametrize("node, tracked", [(0, True), (1, True), (0, False)])
def test_only_node_0_of_a_tracked_stage_follows(cfg, tmp_path, node, tracked):
    from types import SimpleNamespace

    from tasks.stages import train

    cfg.tracking.enabled = tracked
    ctx = SimpleNamespace(mlflow_run_id="0" * 32)
    started = []
    with pytest.MonkeyPatch.context() as mp:
        import tasks.parallel.metrics as metrics

        real = metrics.MetricsFollower
        mp.setattr(metrics, "MetricsFollower", lambda *a, **k: started.append(a) or real(*a, **k))
        with train.stream_metrics(cfg, ctx, tmp_path / "metrics.jsonl", node):
            pass
    assert bool(started) == (node == 0 and tracked), started
