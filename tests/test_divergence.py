"""The divergence guard's decisions and the checkpoints it condemns (tasks/parallel/divergence.py), and the lr schedule
recomputed on resume (tasks.parallel.optim.load_schedule), issue 26: pure logic, fast, no torchrun (the trainer end to
end: tests/test_train.py)."""

from __future__ import annotations

import json
import math

import pytest

from tasks.parallel.divergence import DivergenceGuard, quarantine

V = 512
LN_V = math.log(V)


def run_guard(losses, norms=None, factor=10.0):
    g = DivergenceGuard(V, factor)
    for step, loss in enumerate(losses, 1):
        d = g.check(step, loss, (norms or {}).get(step, 1.0))
        if d:
            return d
    return None


def test_lr_1000_blow_up_is_stopped_and_condemns_the_weights_before_it():
    """train.lr=1000 on main: step 2 loss 1.06e7 (then grad norm 0, a dead model, kept as "last good")."""
    d = run_guard([6.24, 1.06e7])
    assert d.step == 2 and d.bad_from == 1 and "loss diverged" in d.what and "divergence_factor 10" in d.what


def test_zero_gradient_norm_is_a_dead_model():
    d = run_guard([6.2, 6.0, 5.9], norms={3: 0.0})
    assert (d.step, d.bad_from) == (3, 2) and "gradient norm is 0" in d.what


def test_loss_back_at_ln_v_after_it_fell_is_a_dead_model_but_not_at_the_start():
    assert run_guard([LN_V + 0.02, LN_V, LN_V - 0.01]) is None  # a fresh model starts at ln V: healthy
    d = run_guard([LN_V + 0.02, 5.0, 4.2, LN_V])
    assert (d.step, d.bad_from) == (4, 3) and "ln(vocabulary)" in d.what


def test_non_finite_condemns_only_the_step():
    d = run_guard([6.2, float("nan")])
    assert (d.step, d.bad_from, d.what) == (2, 2, "loss became non-finite")
    d = run_guard([6.2, 6.1], norms={2: float("inf")})
    assert d.what == "gradient norm became non-finite"


def test_a_healthy_noisy_curve_passes_and_factor_0_turns_the_loss_rules_off():
    noisy = [6.3 - 0.08 * i + 0.4 * (i % 2) for i in range(40)]  # falling, step to step up and down
    assert run_guard(noisy) is None
    assert run_guard([6.24, 1.06e7], factor=0) is None
    assert run_guard([6.2, 6.0], norms={2: 0.0}, factor=0).what.startswith("gradient norm is 0")


def test_history_of_a_resumed_run_counts():
    g = DivergenceGuard(V, 10.0, history=[LN_V, 5.0, 4.5])
    assert g.check(4, LN_V, 1.0).bad_from == 3  # had fallen before the restart


def _ckpts(d, steps):
    for s in steps:
        (d / f"step-{s}").mkdir(parents=True)
        (d / f"step-{s}" / "meta.json").write_text("{}")


def test_quarantine_sets_condemned_checkpoints_aside(tmp_path):
    from tasks.parallel.checkpoint import latest

    _ckpts(tmp_path, [2, 4, 6])
    assert quarantine(tmp_path, 4) == ["step-4", "step-6"]
    assert latest(tmp_path)[0] == 2
    assert (tmp_path / "step-4.diverged" / "meta.json").is_file() and (tmp_path / "step-6.diverged").is_dir()


def test_launcher_names_the_divergence_and_the_last_good_checkpoint(tmp_path):
    from tasks.parallel.diagnosis import explain

    _ckpts(tmp_path / "checkpoints", [1, 2])
    (tmp_path / "train").mkdir()
    d = run_guard([6.24, 6.0, 1.06e7])
    (tmp_path / "train" / "diagnosis.json").write_text(json.dumps({**d.to_dict(), "last_good_checkpoint": "x"}))
    e = explain(tmp_path / "train", 3, "", [], {}, "step-2")
    msg = str(e)
    assert not e.retryable and "\n" not in msg
    assert msg.startswith("loss diverged (1.06e+07 > train.divergence_factor 10 × median 6.12) at step 3")
    assert f"last good checkpoint {tmp_path / 'checkpoints' / 'step-1'}; set aside as diverged: step-2" in msg


def test_resume_schedule_applies_the_new_config_from_the_resumed_step():
    """Saved at step 3 with lr=1000; resumed with lr=0.003: the first resumed step and every later one use the new
    config's schedule (on main the old base lr came back with the scheduler state)."""
    import torch

    from tasks.config import TrainConfig
    from tasks.parallel.optim import build_optimizers, load_schedule, lr_factor, schedule_change

    def optimizers(cfg):
        return build_optimizers([torch.nn.Linear(4, 4)], cfg)[0]

    old = TrainConfig(lr=1000.0, min_lr=0.0, warmup_steps=2, steps=10)
    opt, sched = optimizers(old)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    new = TrainConfig(lr=0.003, min_lr=0.0003, warmup_steps=2, steps=10)
    opt, sched = optimizers(new)
    opt.load_state_dict(saved_opt)  # what the checkpoint's optimizer state brings back: the old lr
    line = load_schedule(opt, sched, saved_sched)
    want = [new.lr * lr_factor(k, new.warmup_steps, new.steps, new.lr, new.min_lr) for k in range(3, 7)]
    got = []
    for _ in range(4):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(want)
    old_lr = 1000.0 * lr_factor(3, 2, 10, 1000.0, 0.0)  # what the checkpoint would have continued with
    assert line == f"resumed at step 3 with the schedule of this run's config: lr {old_lr:.6g} → {got[0]:.6g}"
    assert schedule_change(0.5, 0.5, 3) is None
