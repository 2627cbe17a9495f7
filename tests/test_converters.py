"""The model-converter registry (tasks/model/converters.py): names resolve to the registered classes, an unknown or
repeated name is one config line, every registration is reachable, and the train step calls post_optimizer_hook
after each update (not after a skipped one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tasks.errors import ConfigError
from tasks.model import build_model, converters, get_preset, materialize
from tests.helpers.train_fixture import shards  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def test_names_build_registered_converters_in_config_order():
    built = converters.build(["math_attention", "npu_fused"], converters.ConvertContext("cpu"))
    assert [type(c).__name__ for c in built] == ["MathAttentionConverter", "NpuFused"]
    assert {"npu_fused", "math_attention"} <= set(converters.known())
    # every registered name, sorted (a converter added later may come anywhere in the list)
    with pytest.raises(ConfigError, match=r"model.converters: unknown converter 'npu_fuse'; known: .*math_attention, "):
        converters.build(["npu_fuse"], converters.ConvertContext("cpu"))
    with pytest.raises(ConfigError, match="'npu_fused' is listed twice"):
        converters.check_names(["npu_fused", "npu_fused"])


def test_every_registration_lives_in_a_provider_module():
    """A converter registered in a module the registry never imports could not be named in the config."""
    registering = set()
    for path in (REPO / "tasks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "register" for d in node.decorator_list
            ):
                registering.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    assert registering == set(converters.PROVIDERS)


def _unit_scale(model) -> None:
    """Weights of std 1/sqrt(fan-in) (norm gains 1): activations of order one, where two different functions (SiLU
    and GELU, say) differ by tenths, not by the 1e-5 a random init's near-zero activations leave."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.mark.parametrize("preset", ["debug", "moe-demo"])
def test_every_converter_keeps_the_plain_models_function(preset):
    """The checkpoints and the HF export hold the plain model, which quantize and evaluate load without converters:
    every registered converter (a newcomer's too, once in PROVIDERS) computes the plain model's logits within
    rounding and keeps its state-dict names — or declares `training_only` (qat_int8) and its `revert()` gives the
    plain model back exactly. On the CPU (npu_fused is the identity here; tests/test_npu_kernels.py checks its
    kernels against reference ops)."""
    import copy
    import dataclasses

    tcfg = dataclasses.replace(get_preset(preset), n_layers=2)
    plain = materialize(build_model(tcfg), "cpu", seed=0).eval()
    _unit_scale(plain)
    tokens = torch.randint(0, tcfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = plain(tokens)
    assert want.std() > 0.3, want.std()  # the regime where a changed function shows
    for name in converters.known():
        model = copy.deepcopy(plain)
        [conv] = converters.build([name], converters.ConvertContext("cpu", tcfg))
        converters.apply(model, [conv])
        assert list(model.state_dict()) == list(plain.state_dict()), name
        with torch.no_grad():
            got = model(tokens)
        if converters.training_only(conv):
            assert not torch.equal(got, want), f"{name}: training_only, but it changed nothing"
            conv.revert()
            with torch.no_grad():
                got = model(tokens)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{name}: revert(): {m}")
        else:
            torch.testing.assert_close(
                got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} changes the model's function: {m}"
            )


def test_math_attention_converter_swaps_and_reverts():
    from tasks.model.transformer import Attention
    from tasks.quant.export import MathAttention

    model = materialize(build_model(get_preset("debug")), "cpu", seed=0)
    [conv] = converters.build(["math_attention"], converters.ConvertContext("cpu"))
    conv.convert(model)
    assert {type(m) for m in model.modules() if isinstance(m, Attention)} == {MathAttention}
    conv.revert()
    assert {type(m) for m in model.modules() if isinstance(m, Attention)} == {Attention}


def test_every_list_of_the_registered_converters_names_them_all():
    """Where a user or a reader picks a converter from a list (docs/trainer.md step 2): the DAG form's Param help, the
    config field's comment, the registry's docstring and docs/trainer.md's "Registered today" name every one."""
    from tasks.pipeline import PARAMS

    repo = Path(__file__).resolve().parent.parent
    config = (repo / "tasks" / "config.py").read_text()
    trainer_md = (repo / "docs" / "trainer.md").read_text()
    lists = {
        "the Model converters Param's help": next(p[4] for p in PARAMS if p[0] == "converters"),
        "tasks/config.py's model.converters comment": config[: config.index("    converters: list[str]")][-600:],
        "tasks/model/converters.py's docstring": converters.__doc__,
        "docs/trainer.md's Registered today": trainer_md[trainer_md.index("Registered today") :][:400],
    }
    for name in converters.known():
        missing = [where for where, text in lists.items() if f"{name} " not in text and f"`{name}`" not in text]
        assert not missing, f"{name} is registered but not named in {missing}"


def test_every_converter_says_what_it_did_in_its_repr():
    """Each rank logs `model converters: <repr>, …` (docs/trainer.md): every registered converter defines its own
    __repr__ (object's would log an address), starting with its name; math_attention's counts the blocks swapped."""
    tcfg = get_preset("debug")
    for name in converters.known():
        cls = converters.REGISTRY[name]
        assert cls.__repr__ is not object.__repr__, f"{name}: {cls.__name__} has no __repr__ of its own"
        model = materialize(build_model(tcfg), "cpu", seed=0)
        [conv] = converters.build([name], converters.ConvertContext("cpu", tcfg))
        converters.apply(model, [conv])
        assert repr(conv).startswith(f"{name}("), repr(conv)
        if name == "math_attention":
            assert repr(conv) == f"math_attention({tcfg.n_layers} Attention)"


def test_a_swap_that_an_earlier_converter_made_moot_is_named_not_skipped():
    """On an NPU, npu_fused gives Attention the subclass NpuRopeAttention (here its swaps applied directly: no NPU);
    a converter listed after it that swaps Attention would find no module of exactly that class and do nothing —
    it fails naming both classes and itself, and leaves the model as it was; the other order fails the same way."""
    from tasks.model.npu_kernels import _SWAPS, NpuRopeAttention
    from tasks.model.transformer import Attention, RMSNorm
    from tasks.quant.export import MathAttentionConverter

    npu_swaps = dict(_SWAPS.values())
    model = build_model(get_preset("debug"))  # meta: converters run before any weight exists
    converters.swap_classes(model, npu_swaps)
    math = MathAttentionConverter()
    with pytest.raises(
        ConfigError,
        match=r"^model.converters: math_attention: Attention modules are already "
        r"NpuRopeAttention \(an earlier converter's class\), so the swap to MathAttention would do "
        r"nothing for them; list one converter per module class",
    ):
        converters.apply(model, [math])
    assert {type(m) for m in model.modules() if isinstance(m, Attention)} == {NpuRopeAttention}

    model = build_model(get_preset("debug"))
    converters.apply(model, [MathAttentionConverter()])  # math_attention first, then npu_fused's swaps
    with pytest.raises(ConfigError, match=r"Attention modules are already MathAttention .* swap to NpuRopeAttention"):
        converters.swap_classes(model, npu_swaps)
    assert {type(m) for m in model.modules() if isinstance(m, RMSNorm)} == {RMSNorm}  # its swaps before it, undone
    converters.apply(model, [MathAttentionConverter()])  # already the converter's own class: nothing to do, no error


class _Counting:
    def __init__(self):
        self.calls = []

    def convert(self, model):
        pass

    def post_optimizer_hook(self, models):
        self.calls.append(float(models[0].norm.weight.detach().sum()))  # sees the updated weights


def test_train_step_runs_post_optimizer_hooks_after_each_update_only():
    from tasks.train.step import single_process

    c = get_preset("debug")
    model = materialize(build_model(c), "cpu", seed=0)
    conv = _Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = single_process(model, opt, grad_clip=1.0, converters=[conv])
    x = torch.randint(0, c.vocab_size, (2, 8))
    before = float(model.norm.weight.detach().sum())
    assert step(x, x).updated and conv.calls and conv.calls[0] != before
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    result = step(x, x)
    assert not result.updated and len(conv.calls) == 1  # skipped: no update, no hook, gradients kept
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_unknown_converter_fails_before_any_worker_starts(cfg, tmp_path, shards):
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    with pytest.raises(ConfigError, match="model.converters: unknown converter 'fp8'; known: ") as e:
        train.prepare(configure(cfg, **{"model.converters": ["npu_fused", "fp8"]}), context(tmp_path, shards))
    assert "\n" not in str(e.value) and not (tmp_path / "logs").exists()
