"""Two closed leftovers. FP16's loss scale has a floor (1, DeepSpeed's min_loss_scale default): it no longer halves
to 0 (a Python float from 2^16 reached 0 after 1,091 overflows in a row, then the unscale divided by zero), and an
overflow at the floor stops the run through the divergence guard's verdict with one line naming the cause and the
fix. A stage's MLflow child run carries the Airflow task's own `airflow.try_number`, so a retried stage's runs are
told apart."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.mlflow_store import fresh_store

VOCAB = 16


class _Tiny(torch.nn.Module):
    """The smallest language model TrainStep runs: logits over VOCAB tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, x):
        return self.out(self.emb(x))


def _batch():
    x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    return x, x.roll(-1, dims=1)


def test_the_loss_scale_stops_at_its_floor_instead_of_underflowing_to_zero():
    from tasks.train.loss_scale import MIN_SCALE, LossScaler

    scaler = LossScaler()  # GradScaler's 2^16
    for n in range(1, 1100):  # beyond the 1,091 halvings that took the scale to 0
        floor = scaler.at_floor
        scaler.update(found_inf=True)
        assert scaler.scale == max(2.0 ** (16 - n), MIN_SCALE) and floor == (n > 16), n
    assert scaler.scale == 1.0 and scaler.skipped == 1099
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert scaler.unscale_and_check([p]) is False and torch.equal(p.grad, torch.full((3,), 2.0))  # no 1/0
    # A scale below the floor (a checkpoint written before it existed) is at the floor: the next overflow stops.
    old = LossScaler()
    old.load_state_dict({**old.state_dict(), "scale": 2.0**-40})
    assert old.at_floor
    old.update(found_inf=True)
    assert old.scale == MIN_SCALE
    # Clean steps still grow it from the floor, as GradScaler's rule does.
    grow = LossScaler(scale=1.0, interval=2)
    grow.update(found_inf=False)
    grow.update(found_inf=False)
    assert grow.scale == 2.0 and not grow.at_floor


def test_gradients_overflowing_at_every_step_stop_the_run_through_the_guard_in_one_line(tmp_path):
    """Every step's gradients overflow (finite loss): 16 halvings take 2^16 to the floor 1 with the step skipped and
    no verdict; the 17th overflow, at the floor, returns the divergence guard's verdict (what the trainer wires into
    TrainStep.check; train_step stops the run on any verdict) naming the cause and the fix, the weights untouched and
    the gradients kept; rank 0's diagnosis.json (failures.write_diagnosis, a real one-rank gloo group) then becomes
    the launcher's one line (diagnosis.explain), not retried."""
    import torch.distributed as dist

    from tasks.parallel.diagnosis import explain
    from tasks.parallel.divergence import Divergence, DivergenceGuard
    from tasks.train.failures import write_diagnosis
    from tasks.train.loss_scale import LossScaler
    from tasks.train.step import single_process

    model, scaler = _Tiny(), LossScaler()
    step = single_process(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0, scaler=scaler)
    guard, at = DivergenceGuard(VOCAB), {"step": 0}
    step.check = lambda loss, norm: guard.check(at["step"], loss, norm)  # as Trainer.__init__ wires it
    model.out.weight.register_hook(lambda g: g * float("inf"))  # this parameter's gradient overflows every step
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for at["step"] in range(1, 17):
        result = step(*_batch())
        assert result.overflow and result.verdict is None and math.isfinite(result.loss), at
    assert scaler.scale == 1.0 and scaler.skipped == 16
    at["step"] = 17
    result = step(*_batch())
    verdict = result.verdict
    assert isinstance(verdict, Divergence) and result.overflow and not result.updated
    assert (verdict.step, verdict.bad_from, verdict.grad_norm) == (17, 17, math.inf)  # condemns this step only
    cause = "FP16 gradients overflowed (inf/NaN) even at the loss scale floor 1 (skipped steps: 17;"
    assert verdict.what.startswith(cause)
    assert "train.precision=bf16" in verdict.what and "train.lr" in verdict.what and "\n" not in verdict.what
    assert scaler.scale == 1.0  # never below the floor
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert not torch.isfinite(model.out.weight.grad).all()  # kept: diagnosis.json names the parameter

    train_dir = tmp_path / "run" / "train"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        write_diagnosis(train_dir, 0, verdict, [model], None)
    finally:
        dist.destroy_process_group()
    diag = json.loads((train_dir / "diagnosis.json").read_text())
    assert diag["what"] == verdict.what and diag["nonfinite_grads_by_rank"] == {"0": ["out.weight"]}
    error = explain(train_dir, 3, "", [], {}, "none")
    assert not error.retryable and "\n" not in str(error)
    assert str(error).startswith(f"{verdict.what} at step 17 (loss ") and "grad norm inf" in str(error)


def test_the_default_check_gets_the_cause_as_its_verdict():
    """Without the trainer's guard (the smoke stage's single_process step) the verdict is the cause itself."""
    from tasks.train.loss_scale import LossScaler
    from tasks.train.step import single_process

    model, scaler = _Tiny(), LossScaler(scale=1.0)
    step = single_process(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0, scaler=scaler)
    model.out.bias.register_hook(lambda g: g * float("inf"))
    result = step(*_batch())
    assert result.overflow and result.verdict == scaler.floor_cause() and scaler.scale == 1.0


def test_a_retried_stage_run_carries_its_own_try_number(tmp_path, monkeypatch):
    """The shard stage of one DAG run under try 1, then under try 2 (Airflow's retry or a cleared task): both child
    runs sit under the one parent run, tagged airflow.try_number 1 and 2 (a real SQLite MLflow store; the stage fails
    at once on a missing input, after its run was opened, which keeps this cheap)."""
    import mlflow

    from tasks.errors import StageError
    from tasks.pipeline import run_for_dag_run

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    uri = fresh_store(tmp_path / "m.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    params = {"preset": "ci-tiny", "data_inputs": [str(tmp_path / "missing.txt")], "seq_len": 16, "vocab_size": 300}
    for try_number in (1, 2):
        with pytest.raises(StageError, match=r"missing.txt does not exist"):
            run_for_dag_run("shard", params, "llm_pipeline", "r1", try_number)
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    parents = client.search_runs([exp.experiment_id], "tags.`pipeline.kind` = 'parent'")
    stages = client.search_runs([exp.experiment_id], "tags.`pipeline.stage` = 'shard'")
    assert len(parents) == 1 and len(stages) == 2
    assert sorted(r.data.tags["airflow.try_number"] for r in stages) == ["1", "2"]
    assert {r.data.tags["mlflow.parentRunId"] for r in stages} == {parents[0].info.run_id}
    assert all(r.data.tags["airflow.run_id"] == "r1" and r.info.status == "FAILED" for r in stages)


def test_a_torchrun_killed_from_outside_is_named_as_such(tmp_path):
    """torchrun SIGKILLed with its ranks: the line was 'torchrun exited with code -9: ' + the log's last three lines
    (a binding line, a RuntimeWarning, a progress line), none of them the cause."""
    from tasks.parallel.diagnosis import explain

    log = "[binding] local rank 1 → CPUs 1\n<frozen runpy>:128: RuntimeWarning: …\nprogress: done after 0s\n"
    error = explain(tmp_path / "train", -9, log, [], {}, "checkpoint step-9")
    assert error.retryable and str(error) == (
        "torchrun was killed by SIGKILL from outside (the kernel's OOM killer, an operator, a scheduler's preemption: "
        "dmesg or the scheduler's events say which); see logs/torchrun.log; a retry resumes from checkpoint step-9"
    )
    assert str(explain(tmp_path / "train", 3, log, [], {}, "none")).startswith("torchrun exited with code 3: ")
