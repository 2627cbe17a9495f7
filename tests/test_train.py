"""The training stage end to end: kill -9 of a rank and automatic resume, two torchrun agents (--nnodes 2), bad
configs rejected before any worker starts, failure diagnosis, the divergence guard (a blown-up or dead model stops,
is never exported, and a resume with a lowered lr follows the new schedule), and the schedule/split arithmetic."""

from __future__ import annotations

import json
import shutil
from tests.helpers.ports import free_port
import threading

import pytest

from tasks.errors import ConfigError, StageError
from tests.helpers.train_fixture import (
    BASE,
    assert_same_curve,
    configure,
    context,
    losses,
    reference_losses,
    shards,  # noqa: F401
    write_spec,
)


@pytest.mark.slow
def test_killed_rank_fails_retryable_and_rerun_resumes_identically(cfg, tmp_path, shards, monkeypatch):
    import mlflow

    from tasks.runner import run_stage

    c = configure(
        cfg,
        **{
            "parallel.dp": 2,
            "parallel.tp": 1,
            "parallel.pp": 1,
            "hardware.nproc_per_node": 2,
            "train.steps": 6,
            "train.checkpoint_every": 2,
        },
    )
    c.tracking.enabled = True
    run_dir = tmp_path / "run"
    args = context(run_dir, shards, no_export=False).args
    monkeypatch.setenv("LLM_PIPELINE_FAULT", "1:4")  # rank 1 SIGKILLs itself at the start of step 4
    with pytest.raises(StageError) as err:
        run_stage("train", c, run_dir, args=args)
    assert err.value.retryable
    # torch elastic's own race (its agent reads rank 0's error file while @record still writes it; seen once in a
    # loaded CI run, as in tests/test_async_checkpoint.py) leaves no end-of-run report naming the dead rank's signal
    raced = "Failed to parse reply file" in (run_dir / "logs" / "torchrun.log").read_text()
    expected = (
        "torchrun's elastic agent crashed reading local rank 0's error file"
        if raced
        else "rank 1 died (killed by SIGKILL) at step 4"
    )
    assert expected in str(err.value)
    assert "resumes from checkpoint step-2" in str(err.value)
    assert max(losses(run_dir)) >= 2

    monkeypatch.delenv("LLM_PIPELINE_FAULT")
    result = run_stage("train", c, run_dir, args=args)  # what Airflow's retry does
    assert_same_curve(losses(run_dir), reference_losses(c, shards, 6), "killed at 4, resumed from 2", steps=range(1, 7))
    assert result["summary"].startswith("6 steps, loss ") and result["summary"].endswith("dp2")
    assert (run_dir / "hf" / "config.json").is_file() and result["checkpoint"].endswith("step-6")
    assert "resumed from" in (run_dir / "logs" / "rank-1.log").read_text()

    client = mlflow.MlflowClient(c.tracking.uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.metrics["train/loss"] == pytest.approx(losses(run_dir)[6])
    assert run.data.params["parallel.dp"] == "2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "train")}
    assert "train/loss.png" in artifacts
    assert run.data.metrics["memory.estimate_over_measured"] > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4", "step-6"]  # keep last 2

    again = run_stage("train", c, run_dir, args=args)  # complete: nothing is retrained
    assert again["reused"] and again["steps"] == 6
    # fewer steps than this run directory already trained: refused, never step-6's model handed back as 4 steps'
    shorter = configure(c, **{"train.steps": 4})
    with pytest.raises(StageError, match=r"train.steps: 4, but .* already holds checkpoint step-6, trained past it"):
        run_stage("train", shorter, run_dir, args=args)


@pytest.mark.slow
def test_two_torchrun_agents_with_nnodes_2_train_together(cfg, tmp_path, shards):
    from tasks.stages import train

    port = free_port()
    sets = {
        "parallel.dp": 2,
        "parallel.tp": 1,
        "parallel.pp": 1,
        "hardware.nproc_per_node": 1,
        "hardware.nnodes": 2,
        "hardware.rdzv_endpoint": f"127.0.0.1:{port}",
        "train.steps": 3,
    }
    results, errors = {}, []

    def node(rank):
        try:
            c = configure(cfg, **sets, **{"hardware.node_rank": rank})
            results[rank] = train.run(c, context(tmp_path / "run", shards))
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a node did not finish in 240 s"
    assert not errors, errors
    assert set(results) == {0, 1} and results[0]["layout"] == "dp2"
    assert results[1]["summary"] == "node 1: trained dp2"
    ref = reference_losses(configure(cfg, **sets), shards, 3)
    assert_same_curve(losses(tmp_path / "run"), ref, "2 nodes × 1 process", steps=range(1, 4))
    assert {p.name for p in (tmp_path / "run" / "logs").iterdir()} >= {
        "rank-0.log",
        "rank-1.log",
        "torchrun-node0.log",
        "torchrun-node1.log",
    }


@pytest.mark.slow
def test_collective_timeout_names_the_rank_that_did_not_arrive(cfg, tmp_path, shards, monkeypatch):
    from tasks.stages import train

    c = configure(
        cfg,
        **{
            "parallel.dp": 2,
            "parallel.tp": 1,
            "parallel.pp": 1,
            "hardware.nproc_per_node": 2,
            "train.steps": 4,
            "train.timeout_s": 10,
        },
    )
    monkeypatch.setenv("LLM_PIPELINE_FAULT", "1:3:hang")  # rank 1 stops responding at the start of step 3
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path, shards))
    assert err.value.retryable
    assert str(err.value).startswith("collective timed out: ranks [1] did not arrive (stuck at step 3 data")
    assert json.loads((tmp_path / "train" / "failures" / "timeout-rank-0.json").read_text())["step"] == 3


# ---- the divergence guard (issue 26; its rules: tests/test_divergence.py) --------------------------------------------

DP2 = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2}
# One rank where the claim is the guard's own rule (what it reads back on a resume, a dead model, the schedule after a
# resume), none of which depends on the rank count: each launch costs one rank (~5 CPU s) less. The guard's stop on
# every rank of a dp2 run is test_lr_1000_… and test_weights_blown_up_… (rank 1's fault). ZeRO 0: FSDP over one rank
# shards nothing, and fully_shard costs the rank an import of torch._dynamo (~2.5 CPU s).
DP1 = {"parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1, "parallel.zero": 0, "hardware.nproc_per_node": 1}
BLOW_UP = {**DP2, "train.lr": 1000.0, "train.steps": 4, "train.checkpoint_every": 1}  # step 2's loss: ~5e6


@pytest.mark.slow
def test_lr_1000_stops_in_one_line_and_exports_nothing(tmp_path, shards, capsys):
    """The CLI, a 4-step run that exports: on main it reported `train: ok` and exported the dead model."""
    from tasks.cli import main

    run = tmp_path / "run"
    sets = [a for k, v in {**BASE, **BLOW_UP}.items() for a in ("--set", f"{k}={v}")]
    rc = main(["train", "--no-tracking", "--run-dir", str(run), "--shard-dir", str(shards), *sets])
    out = capsys.readouterr()
    err = [ln for ln in out.err.strip().splitlines() if not ln.startswith(("warning: ", "progress: "))]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: loss diverged (") and "× median 6.2" in err[0] and ") at step 2 (loss " in err[0]
    assert "stopped before the update, last good checkpoint none; set aside as diverged: step-1" in err[0]
    assert "train: ok" not in out.out + out.err
    assert not (run / "hf").exists() and not (run / "train" / "summary.json").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-1.diverged"]  # never resumed
    diag = json.loads((run / "train" / "diagnosis.json").read_text())
    assert (diag["step"], diag["bad_from"], diag["last_good_checkpoint"]) == (2, 1, None)
    assert sorted(losses(run)) == [1]  # the diverged step is not logged


@pytest.mark.slow
def test_weights_blown_up_by_the_last_update_are_never_saved_or_exported(cfg, tmp_path, shards, monkeypatch):
    """The last step's loss and gradient norm are finite, its update makes rank 1's weights non-finite (fault "inf"):
    on main the run ended ok and exported them. Now the check before the checkpoint stops it: exit 3, one line, the
    step-2 checkpoint is the last good one, nothing of step 3 is saved or exported."""
    from tasks.stages import train

    monkeypatch.setenv("LLM_PIPELINE_FAULT", "1:3:inf")
    c = configure(cfg, **{**DP2, "train.steps": 3, "train.checkpoint_every": 1})
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path, shards, no_export=False))
    msg = str(err.value)
    assert not err.value.retryable and "\n" not in msg
    assert msg.startswith("the weights became non-finite in the update (its loss and gradient norm were finite) at ")
    assert f"stopped before the checkpoint, last good checkpoint {tmp_path / 'checkpoints' / 'step-2'}" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert not (tmp_path / "hf").exists() and not (tmp_path / "train" / "summary.json").exists()


@pytest.mark.slow
def test_zero_gradient_norm_stops_a_dead_model(cfg, tmp_path, shards):
    """The loss rules off (divergence_factor 0): step 2's loss passes, step 3's model is dead (norm exactly 0)."""
    from tasks.stages import train

    c = configure(cfg, **{**BLOW_UP, **DP1, "train.divergence_factor": 0})
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path, shards, no_export=False))
    msg = str(err.value)
    assert not err.value.retryable and "\n" not in msg
    assert msg.startswith("gradient norm is 0 (a dead model: nothing learns) at step 3 (loss ")
    assert f"last good checkpoint {tmp_path / 'checkpoints' / 'step-1'}; set aside as diverged: step-2" in msg
    assert sorted(losses(tmp_path)) == [1, 2] and not (tmp_path / "hf").exists()


def test_stop_training_with_code_0_is_refused():
    """Exit 0 is a finished run, which the worker would export: a hook that wants a clean end calls finish_early."""
    from tasks.train.hooks import StopTraining

    with pytest.raises(ValueError, match=r"non-zero code; to end cleanly, call trainer.finish_early"):
        StopTraining(0, "done")
    assert StopTraining(8, "over the ceiling").code == 8


@pytest.mark.slow
def test_a_hooks_stop_training_is_the_stages_one_line_cause_and_not_retried(cfg, tmp_path, shards, monkeypatch):
    """A hook that raises StopTraining(code, message) (here the "stop" drill at step 3 of 4, checkpoints every step):
    the rank shuts down cleanly, and the stage's error is the hook's own message, with the code and where a rerun
    resumes — not "rank 0 died (exit code 7)", and not retried (a retry would stop the same way)."""
    from tasks.stages import train

    monkeypatch.setenv("LLM_PIPELINE_FAULT", "0:3:stop")
    c = configure(cfg, **{**DP1, "train.steps": 4, "train.checkpoint_every": 1})
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path, shards))
    msg = str(err.value)
    assert not err.value.retryable and "\n" not in msg, msg
    assert msg == (
        "training stopped at step 3: fault injection: stop at step 3 (a hook's StopTraining, exit 7); not retried; "
        "it resumes from checkpoint step-2"
    ), msg
    assert sorted(losses(tmp_path)) == [1, 2]


@pytest.mark.slow
def test_the_guard_remembers_the_losses_before_a_resume(cfg, tmp_path, shards):
    """A 1-step run at lr 1000 ends "ok" (its only update is judged by the next step's loss); extended to 3 steps it
    resumes from step-1 and step 2's loss is compared with step 1's, read back from metrics.jsonl."""
    from tasks.stages import train

    assert train.run(configure(cfg, **{**BLOW_UP, **DP1, "train.steps": 1}), context(tmp_path, shards))["steps"] == 1
    with pytest.raises(StageError) as err:
        train.run(configure(cfg, **{**BLOW_UP, **DP1, "train.steps": 3}), context(tmp_path, shards))
    msg = str(err.value)
    assert msg.startswith("loss diverged (") and "× median 6.2" in msg and ") at step 2 (loss " in msg
    assert "last good checkpoint none; set aside as diverged: step-1" in msg


@pytest.mark.slow
def test_resume_with_a_lowered_lr_follows_the_new_schedule_and_does_not_re_explode(cfg, tmp_path, shards):
    """Checkpoint step-2 was saved by a schedule heading for lr 1000 (its long warm-up kept steps 1–2 healthy); the
    resume with lr 3e-3 must use that lr from step 3 on. On main the old base lr came back with the scheduler state:
    step 3 used 0.006, step 4 ~870, and the loss blew up again."""
    from tasks.parallel.metrics import read_metrics
    from tasks.parallel.optim import lr_factor
    from tasks.stages import train

    high = configure(cfg, **DP1, **{"train.lr": 1000.0, "train.warmup_steps": 500_000, "train.steps": 2})
    train.run(high, context(tmp_path, shards))
    low = configure(cfg, **DP1, **{"train.steps": 6})  # BASE: lr 3e-3, min_lr 3e-4, warm-up 2
    result = train.run(low, context(tmp_path, shards))
    t = low.train
    want = {k: t.lr * lr_factor(k - 1, t.warmup_steps, t.steps, t.lr, t.min_lr) for k in range(3, 7)}
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert {r["step"]: r["lr"] for r in rows if r["step"] > 2} == pytest.approx(want)
    assert result["steps"] == 6 and max(r["loss"] for r in rows) < 6.3
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "resumed at step 2 with the schedule of this run's config: lr 0.006 → 0.003" in log


@pytest.mark.parametrize(
    "sets, expected",
    [
        (
            {"parallel.tp": 3, "hardware.nproc_per_node": 3, "parallel.dp": 1},
            "parallel.tp: 3 does not divide the model's 4 heads",
        ),
        (
            {"parallel.tp": 4, "hardware.nproc_per_node": 4, "parallel.dp": 1},
            "parallel.tp: 4 does not divide the model's 2 KV heads",
        ),
        (
            {"parallel.pp": 4, "hardware.nproc_per_node": 4, "parallel.dp": 1},
            "parallel.pp: 4 pipeline stages exceed the model's 2 layers",
        ),
        ({"parallel.dp": 2, "parallel.tp": 2, "hardware.nproc_per_node": 2}, "dp 2 × tp 2 × pp 1 = 4 ≠ world size 2"),
        (
            {"parallel.pp": 2, "parallel.dp": 1, "train.global_batch": 2, "hardware.nproc_per_node": 2},
            "1 micro-batches per step are fewer than the 2 pipeline stages",
        ),
    ],
)
def test_bad_layouts_fail_before_launch_one_line_each(cfg, tmp_path, shards, sets, expected):
    from tasks.stages import train

    c = configure(cfg, **{"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, **sets})
    with pytest.raises(ConfigError) as err:
        train.run(c, context(tmp_path, shards))
    assert expected in str(err.value)
    assert all("\n" not in p for p in err.value.problems)
    assert not (tmp_path / "logs").exists()  # no worker was started


def test_missing_shard_and_foreign_checkpoint_fail_before_launch(cfg, tmp_path, shards):
    from tasks.stages import train

    c = configure(cfg, **{"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2})
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    victim = sorted(broken.glob("train-*.tar"))[1]
    victim.unlink()
    with pytest.raises(ConfigError, match=f"shard {victim} is missing"):
        train.run(c, context(tmp_path / "a", broken))

    # A complete checkpoint whose meta.json records another model shape (dim 128 instead of 64).
    write_spec(c, tmp_path / "b", shards)
    model = json.loads((tmp_path / "b" / "train" / "launch.json").read_text())["model"]
    step = tmp_path / "b" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "model": {**model, "dim": 128}}))
    with pytest.raises(ConfigError, match=r"written for another model shape \(dim 128 vs 64\); use --fresh"):
        train.run(c, context(tmp_path / "b", shards))


def test_failure_evidence_becomes_one_line_causes(tmp_path):
    from tasks.parallel.diagnosis import explain
    from tasks.parallel.metrics import Heartbeat

    layout = {"dp": 2, "tp": 1, "pp": 1, "zero": 3, "recompute": "none", "micro_batch": 4}
    torchrun_log = (
        "Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
        "  rank      : 3 (local_rank: 1)\n  exitcode  : -9 (pid: 7)\n"
    )
    for r, step in ((0, 5), (1, 5), (2, 5), (3, 4)):
        Heartbeat(tmp_path / "heartbeat", r).beat(step, "compute")
    e = explain(tmp_path, 1, torchrun_log, [], layout, "checkpoint step-4")
    assert e.retryable and str(e).startswith("rank 3 died (killed by SIGKILL) at step 4")

    (tmp_path / "failures").mkdir()
    (tmp_path / "failures" / "timeout-rank-0.json").write_text("{}")
    e = explain(tmp_path, 1, "", [], layout, "checkpoint step-4")
    assert e.retryable and "ranks [3] did not arrive (stuck at step 4 compute" in str(e)
    assert "python -m tasks env" in str(e)

    gb = 10**9  # printed memory is decimal GB (tasks/units.py)
    (tmp_path / "failures" / "oom-rank-1.json").write_text(
        json.dumps(
            {
                "rank": 1,
                "step": 2,
                "estimate_bytes": 50 * gb,
                "memory": {"allocated_bytes": 40 * gb, "reserved_bytes": 60 * gb},
            }
        )
    )
    plans = [dict(layout), {**layout, "zero": 3, "recompute": "full", "micro_batch": 2}]
    e = explain(tmp_path, 1, "", plans, layout, "checkpoint step-0")
    assert not e.retryable and "\n" not in str(e)
    assert "planner estimated 50.0 GB/device; allocated 40.0 GB, reserved 60.0 GB" in str(e)
    assert "expandable_segments:True" in str(
        e
    ) and "next feasible plan: dp=2, tp=1, pp=1, zero=3, recompute=full, micro_batch=2" in str(e)


def test_lr_schedule_and_pipeline_split():
    from tasks.parallel.optim import lr_factor
    from tasks.parallel.pp import layer_ranges

    lrs = [1e-3 * lr_factor(s, 2, 10, 1e-3, 1e-4) for s in range(10)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)  # linear warm-up
    assert lrs[2] == pytest.approx(1e-3) and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert 1e-3 * lr_factor(10, 2, 10, 1e-3, 1e-4) == pytest.approx(1e-4)  # cosine ends at min_lr
    assert layer_ranges(5, 2) == [(0, 3), (3, 5)] and layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_unpinned_degrees_come_from_the_plan(cfg):
    from tasks.layout import resolve

    c = configure(cfg, **{"parallel.dp": 0, "parallel.tp": 0, "parallel.pp": 0})
    plan = {
        "parallel": {
            "dp": 1,
            "tp": 2,
            "pp": 2,
            "zero": 2,
            "recompute": "full",
            "pp_schedule": "gpipe",
            "microbatches": 4,
            "micro_batch": 2,
            "virtual_stages": 1,
            "sequence_parallel": False,
        }
    }
    explicit = {"parallel.zero", "parallel.recompute", "train.micro_batch"} & c.explicit
    c.explicit.difference_update(explicit)
    lay = resolve(c, plan, 4)  # BASE's zero/recompute/micro-batch as a preset's values: the plan's replace them
    assert (lay.dp, lay.tp, lay.pp, lay.zero, lay.recompute, lay.pp_schedule) == (1, 2, 2, 2, "full", "gpipe")
    assert not lay.sequence_parallel and lay.n_microbatches == 4
    c.explicit.update(explicit)  # set explicitly (--set, Params): kept (the plan stage planned only them)
    assert (resolve(c, plan, 4).zero, resolve(c, plan, 4).recompute) == (3, "none")
    assert (resolve(c, None, 4).dp, resolve(c, None, 4).tp) == (4, 1)  # no plan: all ranks data-parallel
    c.parallel.tp = 2  # a pinned degree wins over the plan's
    assert resolve(c, {"parallel": {"dp": 4, "tp": 1, "pp": 1}}, 4).tp == 2


def test_cpu_world_size_comes_from_the_layout_unless_nproc_is_pinned(cfg):
    from tasks.launch.torchrun import world

    plan = {"parallel": {"dp": 2, "tp": 2, "pp": 1}}
    c = configure(cfg, **{"hardware.nproc_per_node": 0, "parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1})
    assert world(c, None)[1:] == (1, 1)  # pinned dp1: one rank, not 2
    c = configure(cfg, **{"hardware.nproc_per_node": 0, "parallel.dp": 0, "parallel.tp": 0, "parallel.pp": 0})
    assert world(c, plan)[1:] == (4, 4) and world(c, None)[1:] == (2, 2)  # the plan's 2×2; no plan: 2
    c = configure(
        cfg,
        **{"hardware.nproc_per_node": 0, "hardware.nnodes": 2, "parallel.dp": 4, "parallel.tp": 1, "parallel.pp": 1},
    )
    assert world(c, None)[1:] == (2, 4)  # 4 ranks over 2 nodes
    c = configure(cfg, **{"hardware.nproc_per_node": 2, "parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1})
    assert world(c, None)[1:] == (2, 2)  # pinned: kept, and the check explains
