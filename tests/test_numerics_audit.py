"""The training step's numerics in one process (tasks/train/step.py, loss_scale.py, tasks/parallel/optim.py):
micro-batch accumulation gives one big batch's gradient, clipping bites at the global norm, an FP16 overflow skips
the step without touching weights, optimizer state or schedule; and what the numerics audit fixed: the one-process
step (smoke) scales the MoE aux loss's gradient under FP16, a non-finite norm leaves the gradients as backward made
them (the diagnosis names the bad one), and an FP16 non-finite loss reaches the divergence guard instead of being
skipped as an overflow forever. Tiny models, no torchrun."""

from __future__ import annotations

import pytest
import torch

from tasks.model import TransformerConfig
from tasks.model.transformer import build_model, materialize

V = 256


def _model(preset: str = "debug", **shape):
    return materialize(build_model(TransformerConfig.from_preset(preset, vocab_size=V, **shape)), "cpu", seed=0)


def _batch(n: int = 8, seq: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (n, seq), generator=g), torch.randint(0, V, (n, seq), generator=g)


def _grads_after(step, model) -> dict:
    """Run `step` on the batch; the gradients the optimizer saw (captured in after_update)."""
    seen = {}
    step.after_update.append(lambda: seen.update({n: p.grad.clone() for n, p in model.named_parameters()}))
    return step(*_batch()), seen


@pytest.mark.parametrize("n_micro,clip", [(2, 0.0), (4, 0.05)])
def test_micro_batches_give_one_big_batchs_gradient_and_clip_at_the_global_norm(n_micro, clip):
    from tasks.model.loss import lm_loss
    from tasks.train.step import PlainStep, TrainStep

    ref = _model()
    x, y = _batch()
    loss = lm_loss(ref(x), y)
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    norm = torch.sqrt(sum(g.pow(2).sum() for g in want.values())).item()
    assert clip == 0 or clip < norm / 10  # the clip bites

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = TrainStep(PlainStep(model, n_micro), [(opt, None)], list(model.parameters()), clip)
    result, got = _grads_after(step, model)
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    assert result.grad_norm == pytest.approx(norm, rel=1e-5)  # the pre-clip norm is reported
    coef = clip / (norm + 1e-6) if clip else 1.0
    for n, g in want.items():
        torch.testing.assert_close(got[n], g * coef, rtol=1e-4, atol=1e-8)


def test_an_fp16_overflow_skips_the_step_without_touching_weights_optimizer_or_schedule():
    from tasks.config import TrainConfig
    from tasks.parallel.optim import build_optimizers
    from tasks.train.loss_scale import LossScaler
    from tasks.train.step import single_process

    model = _model()
    [(opt, sched)] = build_optimizers([model], TrainConfig(warmup_steps=2, steps=10))
    scaler = LossScaler()
    step = single_process(model, opt, 1.0, scheduler=sched, scaler=scaler)
    assert step(*_batch()).updated and scaler.state_dict()["_growth_tracker"] == 1
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {id(p): s["exp_avg"].clone() for p, s in opt.state.items()}
    lr, epoch = opt.param_groups[0]["lr"], sched.last_epoch
    wq = dict(model.named_parameters())["layers.0.attention.wq.weight"]
    hook = wq.register_hook(lambda g: g * float("inf"))
    result = step(*_batch())
    hook.remove()
    assert result.overflow and result.grad_norm is None and result.lr == lr
    assert (scaler.scale, scaler.skipped, scaler.tracker) == (2.0**15, 1, 0)
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(moments[id(p)], s["exp_avg"]) for p, s in opt.state.items())
    assert (sched.last_epoch, opt.param_groups[0]["lr"]) == (epoch, lr)  # the schedule waits for the next real update
    assert all(p.grad is None for p in model.parameters())
    assert step(*_batch()).updated and sched.last_epoch == epoch + 1


def test_the_one_process_fp16_step_scales_the_moe_aux_gradient_like_the_loss():
    """Smoke's FP16 curve (single_process with training's LossScaler) on a MoE model: the aux loss's gradient was not
    multiplied by the scale, then divided by it with the rest — 1/65536 of it left: the router's gradient norm was
    0.002852 against FP32's 0.003102 (moe-demo at dim 64, 1 layer)."""
    from tasks.train.loss_scale import LossScaler
    from tasks.train.step import single_process

    grads = []
    for scaler in (None, LossScaler()):
        model = _model("moe-demo", dim=64, n_layers=1, ffn_dim=64)
        step = single_process(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0, scaler=scaler)
        result, got = _grads_after(step, model)
        assert result.updated
        grads.append(got["layers.0.moe.router.weight"])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-9)


def test_a_non_finite_norm_leaves_the_gradients_for_the_diagnosis():
    """One NaN in one gradient, train.grad_clip 1 (the default): the NaN clip coefficient made all 21 gradients NaN,
    and diagnosis.json's non-finite list (tasks/train/failures.py) named tok_embeddings first, not the bad one."""
    from tasks.train.step import single_process

    model = _model()
    named = dict(model.named_parameters())
    good = {}

    def poison(g):
        g = g.clone()
        g[0, 0] = float("nan")
        return g

    named["layers.1.feed_forward.w2.weight"].register_hook(poison)
    named["output.weight"].register_hook(lambda g: good.setdefault("output", g.clone()))
    result = single_process(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0)(*_batch())
    assert result.verdict is not None and result.grad_norm != result.grad_norm  # NaN norm: not updated
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert bad == ["layers.1.feed_forward.w2.weight"]
    assert torch.equal(named["output.weight"].grad, good["output"])  # unclipped, as backward made it


def test_an_fp16_non_finite_loss_is_stopped_by_the_guard_not_skipped_as_an_overflow():
    """A NaN loss is computed before any scaling: lowering the scale cannot cure it. It was taken for an overflow
    (skipped, scale halved, the guard never asked) at every step — the run went on to its end, exporting weights
    that never trained; under BF16 the guard stops it at once. Now FP16 does the same."""
    from tasks.parallel.divergence import DivergenceGuard
    from tasks.train.loss_scale import LossScaler
    from tasks.train.step import single_process

    model = _model()
    with torch.no_grad():
        model.output.weight.fill_(3e38)  # logits overflow: NaN loss
    scaler = LossScaler()
    step = single_process(model, torch.optim.SGD(model.parameters(), lr=0.1), 1.0, scaler=scaler)
    guard = DivergenceGuard(V)
    step.check = lambda loss, norm: guard.check(1, loss, norm)
    result = step(*_batch())
    assert not result.overflow and result.verdict is not None
    assert result.verdict.what == "loss became non-finite" and result.verdict.bad_from == 1
    assert (scaler.scale, scaler.skipped) == (2.0**16, 0)
