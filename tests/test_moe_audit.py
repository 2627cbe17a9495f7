"""MoE audit findings (in-process, function level): mixture-of-experts settings on a dense model fail in one line
instead of being ignored, FP16's loss scale reaches the load-balancing loss's gradient, and moe_aux_loss reports the
router's balance with the loss turned off (never a 0.0 that reads as perfect balance)."""

from __future__ import annotations

import pytest
import torch

from tasks.errors import ConfigError
from tasks.model import build_model, get_preset, lm_loss, materialize
from tasks.model.moe import collect_stats, set_loss_scaler, summarise

TOKENS = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(4))


def _moe_model(**kw):
    tcfg = get_preset("moe-demo")
    tcfg.vocab_size, tcfg.n_layers, tcfg.dim = 256, 1, 64
    for k, v in kw.items():
        setattr(tcfg, k, v)
    return materialize(build_model(tcfg), "cpu", seed=0)


@pytest.mark.parametrize(
    "sets, named",
    [
        (["model.top_k=4"], "model.top_k"),
        (["model.capacity_factor=0.5", "model.aux_loss_coef=0.1"], "model.aux_loss_coef, model.capacity_factor"),
        (["model.moe_ffn_dim=32"], "model.moe_ffn_dim"),
    ],
)
def test_moe_settings_on_a_dense_model_are_refused(sets, named):
    """ci-tiny's model is the dense `debug` preset: a router setting there has nothing to change — refused in one
    line naming the keys, not trained as if it applied; on moe-demo the same settings take effect."""
    from tasks.config import load_config
    from tasks.model.resolve import from_pipeline

    with pytest.raises(ConfigError, match=f"^{named}: mixture-of-experts settings, but model.preset debug is dense"):
        from_pipeline(load_config("ci-tiny", sets=sets), 512)
    moe = from_pipeline(load_config("ci-tiny", sets=[*sets, "model.preset=moe-demo"]), 512)
    for s in sets:
        key, value = s.removeprefix("model.").split("=")
        assert getattr(moe, key) == type(getattr(moe, key))(value)


def _router_grad(coef: float, scaler) -> torch.Tensor:
    """The router's gradient after one PlainStep (FP16's loss scale when `scaler`, unscaled as the trainer does)."""
    from tasks.train.step import PlainStep

    model = _moe_model(aux_loss_coef=coef)
    if scaler is not None:
        set_loss_scaler(model, scaler)  # what tasks.train.build.build_step does under train.precision=fp16
    PlainStep(model, 2, None, lm_loss, scaler)(TOKENS[:, :-1], TOKENS[:, 1:])
    grad = model.layers["0"].moe.router.weight.grad.clone()
    return grad / scaler.scale if scaler is not None else grad


def test_fp16_loss_scale_reaches_the_aux_loss_gradient():
    """Under FP16 the LM loss is multiplied by the loss scale (2**16) and every gradient divided by it: the aux
    loss's gradient must be scaled too, or the load-balancing loss is silently 65536 times weaker."""
    from tasks.train.loss_scale import LossScaler

    aux_plain = _router_grad(1.0, None) - _router_grad(0.0, None)
    aux_fp16 = _router_grad(1.0, LossScaler()) - _router_grad(0.0, LossScaler())
    assert float(aux_plain.norm()) > 0.1
    torch.testing.assert_close(aux_fp16, aux_plain, atol=1e-5, rtol=1e-4)


def test_build_step_gives_the_moe_layers_the_fp16_loss_scaler():
    """The trainer's wiring: build_step under fp16 hands its LossScaler to every MoE layer (bf16: none)."""
    from types import SimpleNamespace

    from tasks.train.build import ModelParts, build_step

    for precision, want in (("fp16", True), ("bf16", False)):
        model = _moe_model()
        parts = ModelParts(stages=[(0, model)], n_stages=1)
        lay = SimpleNamespace(pp=1, zero=3, n_microbatches=1)
        opts = SimpleNamespace(replicas=[], pairs=[], owner={})
        step = build_step(parts, opts, None, lay, torch.device("cpu"), precision, 1.0)
        moe = model.layers["0"].moe
        assert (moe.loss_scaler is not None) == want
        if want:
            assert moe.loss_scaler is step.scaler


def test_aux_loss_statistic_is_reported_with_the_loss_off():
    """model.aux_loss_coef=0 turns the loss off (no gradient) but moe_aux_loss still measures the routing's balance:
    the same figure as with the loss on, not 0.0."""
    figures = []
    for coef in (0.0, 0.01):
        model = _moe_model(aux_loss_coef=coef)
        model(TOKENS).float().pow(2).mean().backward()
        stats = collect_stats([model])
        assert stats["calls"] == 1
        figures.append(summarise(**stats)["moe_aux_loss"])
    assert figures[0] > 0.9  # E · Σ f·P: top_k (2) when perfectly balanced, never 0 for a real router
    assert figures[0] == pytest.approx(figures[1], rel=1e-6)
