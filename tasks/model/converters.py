"""Model converters: named changes to a built model, applied in the order `model.converters` lists them — the
mechanism for kernel swaps and export-friendly modules (torchtitan's `ModelConverter` protocol,
torchtitan/protocols/model_converter.py; torchtitan-npu registers its NPU kernels the same way). Registered:
`npu_fused` (tasks/model/npu_kernels.py), `math_attention` (tasks/quant/export.py) and `qat_int8`
(tasks/quant/fake_quant.py: INT8 fake quantization, which the quantize stage's QAT applies too).

The trainer builds the model on the meta device and calls `convert(model)` on each converter before any parallelism
(tasks/train/build.py); the smoke stage does the same on its single-process model (on its device, before the weights
load). A converter that keeps state in step with the weights (a fake-quant scale, an amax history) also defines
`post_optimizer_hook(models)`, which the train step calls after every optimizer step.

Adding one (docs/trainer.md): a class taking a `ConvertContext`, decorated `@register("name")`, in a module listed in
PROVIDERS; then `model.converters: [name, npu_fused]`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

from tasks.errors import ConfigError

# Modules whose import registers converters (the registry imports them on first use).
PROVIDERS = ("tasks.model.npu_kernels", "tasks.quant.export", "tasks.quant.fake_quant")

REGISTRY: dict[str, type] = {}


class ModelConverter(Protocol):
    """The converted model computes the plain model's function, up to rounding (other kernels, another attention
    formula): the checkpoints and the HF export hold the plain model, which quantize and evaluate load without
    converters. A converter that trains another function on purpose (qat_int8: fake-quantized weights) sets
    `training_only = True` and has `revert()`, which gives the plain model back. tests/test_converters.py holds
    every registered converter to this. A new architecture (another activation, a new layer) is a model family,
    not a converter: its export would still say the plain model's."""

    def convert(self, model) -> None:
        """Change `model` in place (it may be on the meta device: swap classes, wrap modules; no weights yet)."""

    # Optional: def post_optimizer_hook(self, models: list) -> None — after each optimizer step.
    # Optional: training_only = True, with def revert(self) -> None (see the class docstring).


@dataclass(frozen=True)
class ConvertContext:
    """What a converter may look at when it is built: the device type ("npu" | "cuda" | "cpu"), the model shape, the
    run's PipelineConfig (None outside a pipeline run, e.g. a benchmark) and the parallel Layout (None: one process).
    A converter refuses what it cannot do in its constructor (ConfigError, one line): the train stage builds them once
    before any rank starts."""

    device_type: str = "cpu"
    tcfg: Any = None
    cfg: Any = None
    layout: Any = None


def register(name: str):
    """Class decorator: `@register("npu_fused") class NpuFused: ...` makes it buildable by that name."""

    def add(cls):
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"model converter {name!r} registered twice: {REGISTRY[name].__name__}, {cls.__name__}")
        REGISTRY[name] = cls
        cls.converter_name = name
        return cls

    return add


def known() -> list[str]:
    for module in PROVIDERS:
        importlib.import_module(module)
    return sorted(REGISTRY)


def check_names(names) -> None:
    """ConfigError (one line) for a name no provider registers or a name listed twice."""
    names_known = known()
    unknown = [n for n in names if n not in names_known]
    if unknown:
        raise ConfigError(f"model.converters: unknown converter {unknown[0]!r}; known: {', '.join(names_known)}")
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise ConfigError(f"model.converters: {twice[0]!r} is listed twice; list each converter once")


def build(names, ctx: ConvertContext) -> list[ModelConverter]:
    """The converters `names` (config order), each built with `ctx`."""
    check_names(names)
    return [REGISTRY[n](ctx) for n in names]


def apply(model, converters) -> None:
    for converter in converters:
        try:
            converter.convert(model)
        except SwapConflict as e:
            name = getattr(type(converter), "converter_name", type(converter).__name__)
            raise ConfigError(f"model.converters: {name}: {e} (model.converters lists them in order)") from None


def training_only(converter) -> bool:
    """Whether `converter` trains another function than the plain model's on purpose (ModelConverter's docstring)."""
    return bool(getattr(converter, "training_only", False))


def post_optimizer(converters, models: list) -> None:
    """Each converter's post_optimizer_hook, if it has one (the train step calls this after the optimizer step)."""
    for converter in converters:
        hook = getattr(converter, "post_optimizer_hook", None)
        if hook is not None:
            hook(models)


class SwapConflict(ConfigError):
    """A swap met modules of its class that an earlier converter already gave another class."""


def swap_classes(model, swaps: dict[type, type], only=None) -> list[tuple[Any, type]]:
    """Give every module whose type is exactly a key of `swaps` the mapped class (a subclass with other kernels:
    parameters, names and state dict unchanged); returns (module, old class) pairs for `restore`. `only`: a set of
    module names, the modules considered (None: all).

    A module of a key's subclass (an earlier converter swapped it: npu_fused's NpuFeedForward is a FeedForward) is
    not swapped again, and not skipped in silence either: SwapConflict names both classes (`apply` adds which
    converter), since one of the two converters would otherwise do nothing for those modules."""
    done = []
    for name, module in model.named_modules():
        if only is not None and name not in only:
            continue
        new = swaps.get(type(module))
        if new is not None:
            done.append((module, type(module)))
            module.__class__ = new
            continue
        for old, want in swaps.items():
            if isinstance(module, old) and type(module) is not want:
                restore(done)
                raise SwapConflict(
                    f"{old.__name__} modules are already {type(module).__name__} (an earlier converter's class), so "
                    f"the swap to {want.__name__} would do nothing for them; list one converter per module class"
                )
    return done


def restore(swapped: list[tuple[Any, type]]) -> None:
    """Undo `swap_classes`."""
    for module, old in swapped:
        module.__class__ = old
