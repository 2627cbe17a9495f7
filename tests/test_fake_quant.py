"""The `qat_int8` model converter (tasks/quant/fake_quant.py): on a meta-built model, as the trainer applies it, the
layers the quantize stage would make INT8 compute with weights on an int8 grid (per output channel) and, for W8A8,
int8 activations per token; the state dict, tied weights and skipped layers are untouched; revert gives back the
exact plain model; what it cannot do (tensor parallelism, W8A8 experts) is one config line before any rank starts.
Under FSDP2 it trains step for step like one process with it (tests/test_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tasks.errors import ConfigError
from tasks.layout import Layout
from tasks.model import build_model, converters, get_preset, materialize
from tests.helpers.train_fixture import shards  # noqa: F401

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _converted(tcfg, cfg=None, seed=0):
    """The trainer's order: meta build → converters → weights."""
    model = build_model(tcfg, "meta")
    [conv] = converters.build(["qat_int8"], converters.ConvertContext("cpu", tcfg, cfg))
    converters.apply(model, [conv])
    return materialize(model, "cpu", seed=seed), conv


def _on_int8_grid(w: torch.Tensor, scale: torch.Tensor) -> bool:
    """Every element is an integer in [-128, 127] times its row's scale (symmetric int8 per output channel)."""
    q = w.detach().double() / scale.detach().double().reshape(*w.shape[:-1], 1)
    return bool(((q - q.round()).abs() < 1e-3).all() and q.min() >= -128.001 and q.max() <= 127.001)


def _row_scale(w: torch.Tensor) -> torch.Tensor:
    return w.detach().abs().amax(dim=-1) / 127.0


def test_chosen_linears_compute_with_int8_weights_and_nothing_else_changes():
    from torchao.quantization.qat import FakeQuantizedLinear

    tcfg = get_preset("debug")
    plain = materialize(build_model(tcfg, "meta"), "cpu", seed=0)
    model, conv = _converted(tcfg)
    assert "qat_int8" in converters.known() and repr(conv) == "qat_int8(int8_weight_only: 14 Linear)"
    fq = {n for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}
    linears = {n for n, m in plain.named_modules() if isinstance(m, nn.Linear)}
    # Default quantize.skip_layers ["lm_head", "embed"]: every Linear but the output projection.
    assert fq == linears - {"output"} and len(fq) == 14
    assert list(model.state_dict()) == list(plain.state_dict())  # the checkpoint and export keys
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, plain.state_dict()[name])  # same init: a converter holds no weights
    # The fake-quantized weight is on an int8 grid; the weight itself is not (training keeps full precision).
    wq = model.layers["0"].attention.wq
    fake = wq.weight_fake_quantizer(wq.weight)  # computes its per-channel scale from the weight
    scale = wq.weight_fake_quantizer.scale
    assert scale.numel() == wq.out_features and _on_int8_grid(fake, scale) and not _on_int8_grid(wq.weight, scale)
    # The model's forward is the plain model's with every chosen weight replaced by its fake-quantized self.
    with torch.no_grad():
        for name in fq:
            m = model.get_submodule(name)
            plain.get_submodule(name).weight.copy_(m.weight_fake_quantizer(m.weight))
        torch.testing.assert_close(model(TOKENS), plain(TOKENS), rtol=1e-5, atol=1e-6)
        unquantized = materialize(build_model(tcfg, "meta"), "cpu", seed=0)(TOKENS)
        assert not torch.allclose(model(TOKENS), unquantized, rtol=1e-6, atol=1e-7)
        conv.revert()  # back to Linear: the plain model's outputs exactly
        assert not any(isinstance(m, FakeQuantizedLinear) for m in model.modules())
        assert torch.equal(model(TOKENS), unquantized)


def test_w8a8_fake_quantizes_activations_per_token_and_skip_layers_are_honoured(cfg):
    from tests.helpers.train_fixture import configure

    c = configure(cfg, **{"quantize.method": "int8_dynamic", "quantize.skip_layers": ["lm_head", "embed", "wo"]})
    model, conv = _converted(get_preset("debug"), c)
    assert repr(conv) == "qat_int8(int8_dynamic: 12 Linear)"
    assert type(model.layers["0"].attention.wo) is nn.Linear  # skipped
    wq = model.layers["0"].attention.wq
    act = wq.activation_fake_quantizer
    assert act is not None and act.config.granularity.__class__.__name__ == "PerToken"
    x = torch.randn(3, 5, 64)
    q = act(x)
    assert not torch.equal(q, x) and all(len(torch.unique(t)) <= 256 for t in q.reshape(-1, 64))


def test_tied_output_stays_tied_when_lm_head_is_not_skipped(cfg):
    from tests.helpers.train_fixture import configure

    tcfg = get_preset("debug")
    tcfg.tie_embeddings = True
    model, conv = _converted(tcfg, configure(cfg, **{"quantize.skip_layers": ["embed"]}))
    out = model.output
    assert type(out).__name__ == "FakeQuantizedLinear" and out.weight is model.tok_embeddings.weight
    conv.revert()
    assert type(out).__name__ == "TiedOutput" and out.weight is model.tok_embeddings.weight


def test_moe_experts_are_fake_quantized_per_row():
    from tasks.quant.fake_quant import FakeQuantExperts

    tcfg = get_preset("moe-demo")
    tcfg.vocab_size = 256
    model, conv = _converted(tcfg)
    experts = [m for m in model.modules() if isinstance(m, FakeQuantExperts)]
    # The router is a Linear the quantize stage quantizes unless skip_layers names it: fake-quantized too.
    routers = [m.router for m in model.modules() if hasattr(m, "router")]
    assert len(experts) == len(routers) == 4 and all(type(r).__name__ == "FakeQuantizedLinear" for r in routers)
    assert repr(conv).startswith("qat_int8(int8_weight_only: ") and repr(conv).endswith(" Linear, 4 experts)")
    e = experts[0]
    w1, w2, w3 = e.expert_weights()
    assert all(_on_int8_grid(q, _row_scale(w)) for q, w in zip((w1, w2, w3), (e.w1, e.w2, e.w3)))
    assert not _on_int8_grid(e.w1, _row_scale(e.w1))
    w1.sum().backward()  # straight through: the gradient reaches the full-precision weight
    assert torch.equal(e.w1.grad, torch.ones_like(e.w1))


def test_what_it_cannot_do_is_one_config_line(cfg, tmp_path, shards):  # noqa: F811
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    with pytest.raises(ConfigError, match=r"^model.converters: qat_int8 does not run under tensor parallelism") as e:
        converters.build(["qat_int8"], converters.ConvertContext("cpu", get_preset("debug"), None, Layout(tp=2)))
    assert "\n" not in str(e.value)
    moe = get_preset("moe-demo")
    w8a8 = configure(cfg, **{"quantize.method": "smoothquant"})
    with pytest.raises(ConfigError, match=r"qat_int8 with quantize.method=smoothquant: MoE experts \(layers.0.moe.ex"):
        converters.build(["qat_int8"], converters.ConvertContext("cpu", moe, w8a8))
    # Every MoE layer's experts skipped (by name, one by one): W8A8 on the rest is fine.
    skipped = configure(
        w8a8, **{"quantize.skip_layers": ["lm_head", "embed", *(f"layers.{i}.mlp.experts" for i in range(4))]}
    )
    converters.build(["qat_int8"], converters.ConvertContext("cpu", moe, skipped))
    # The train stage builds the converters before any rank: tp2 fails there, nothing launched.
    c = configure(cfg, **{"model.converters": ["qat_int8"], "parallel.dp": 1, "parallel.tp": 2})
    with pytest.raises(ConfigError, match="parallel.tp=2"):
        train.prepare(c, context(tmp_path, shards))
    assert not (tmp_path / "logs").exists()


def test_with_qat_int8_a_resume_names_a_changed_layer_choice(cfg, tmp_path):
    """quantize.method and skip_layers shape a qat_int8 run (they choose what it fake-quantizes): a resume with them
    changed is warned about like any training-shaping change; without the converter they shape nothing."""
    import json

    from tasks.parallel.checkpoint import config_changes, shaping_config
    from tests.helpers.train_fixture import configure

    keep = {"model.converters": ["qat_int8"], "quantize.skip_layers": ["lm_head", "embed"]}
    qat = configure(cfg, **keep).to_dict()
    (tmp_path / "meta.json").write_text(json.dumps({"shaping": shaping_config(qat)}))
    changed = configure(cfg, **{"model.converters": ["qat_int8"], "quantize.skip_layers": ["lm_head"]}).to_dict()
    assert config_changes(tmp_path, changed) == ["quantize.skip_layers: ['lm_head', 'embed'] → ['lm_head']"]
    plain = configure(cfg, **{"quantize.skip_layers": ["lm_head"]}).to_dict()
    assert not any(k.startswith("quantize.") for k in shaping_config(plain))
