"""The `qat_int8` model converter: INT8 fake quantization of the layers the quantize stage would make INT8, so that
training sees the rounding the deployed model will have (quantization-aware training).

- Linear layers become torchao's `FakeQuantizedLinear` (torchao/quantization/qat/linear.py), by a class swap that
  keeps each module's own weight and bias (a tied weight stays tied, the state dict keeps its keys) and gives it the
  fake quantizers `QATConfig(step="prepare")` would: int8 per channel, symmetric, for the weight; with W8A8
  (`quantize.method` int8_dynamic or smoothquant) also int8 per token for the activations — asymmetric, the only
  per-token mode torchao 0.18's IntxFakeQuantizer implements. Those quantizers compute their scales from the tensor
  at every forward (no range learning), so they hold no state: nothing to materialise after a meta-device build,
  nothing in a checkpoint.
- MoE routed experts (stacked [E, out, in] weights, not Linear layers) become `FakeQuantExperts`: int8 per row,
  symmetric (as the PTQ path quantizes them, tasks/quant/torchao_backend._quantize_experts), with a
  straight-through gradient.

Which layers: the names given (the quantize stage's QAT passes the ones PTQ chose), else the quantize stage's own
rule on this model (tasks/quant/plan.select_layers with `quantize.skip_layers` and `quantize.method`), Linear layers
and experts only (an Embedding PTQ would quantize is not fake-quantized; torchao's QAT prepares Linear layers).

Where it runs: the quantize stage's QAT (tasks/quant/qat.py) and any training run that lists it in
`model.converters` (the trainer applies it on the meta device before FSDP2/PP/EP; smoke on its one model). Not
under tensor parallelism: a per-channel or per-token scale is a reduction over the whole weight row or activation
token, which a TP shard (a DTensor) does not hold, so the converter refuses tp > 1 in one line before any rank starts.
"""

from __future__ import annotations

import torch
from torch import nn

from tasks.errors import ConfigError, StageError
from tasks.model.converters import ConvertContext, register, restore, swap_classes
from tasks.model.moe import GroupedExperts


def fake_quant_configs(method: str):
    """(activation config or None, weight config) of torchao IntxFakeQuantizeConfig for a quantize.method."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    weight = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
    if method == "int8_weight_only":
        return None, weight
    if method in ("int8_dynamic", "smoothquant"):
        return IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False), weight
    raise StageError(f"quantize.method: {method!r} has no QAT recipe (int8_weight_only, int8_dynamic, smoothquant)")


def fake_int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row (the last dimension), as Int8WeightOnlyConfig quantizes: w → round(w / s)·s with
    s = max|row| / 127; the gradient passes straight through."""
    scale = w.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale), -128, 127) * scale
    return w + (q - w).detach()


class FakeQuantExperts(GroupedExperts):
    """GroupedExperts whose three stacked weights are fake-quantized int8 per row at every forward."""

    def expert_weights(self):
        return tuple(fake_int8_rows(w) for w in super().expert_weights())


@register("qat_int8")
class QatInt8:
    """Fake INT8 on the chosen Linear layers and experts (module docstring); `revert` undoes it (the fine-tuned
    weights stay). Training only: the export holds the plain model, which the quantize stage then makes INT8."""

    training_only = True

    def __init__(self, ctx: ConvertContext | None = None, layers=None, method: str | None = None):
        """`layers`, `method`: the quantize stage's QAT passes PTQ's choice; a training run takes them from its
        config (quantize.skip_layers, quantize.method)."""
        ctx = ctx or ConvertContext()
        q = ctx.cfg.quantize if ctx.cfg is not None else None
        self.method = method or (q.method if q is not None else "int8_weight_only")
        self.skip_layers = list(q.skip_layers) if q is not None else ["lm_head", "embed"]
        self.layers = None if layers is None else list(layers)
        self.swapped: list = []
        self.quantizer_attrs: list = []
        tp = ctx.layout.tp if ctx.layout is not None else 1
        if tp > 1:
            raise ConfigError(
                f"model.converters: qat_int8 does not run under tensor parallelism (parallel.tp={tp}): its per-channel "
                "and per-token scales need whole weight rows and tokens, which a TP shard does not hold; set "
                "parallel.tp=1 (FSDP2, PP and EP are fine) or drop qat_int8"
            )
        if ctx.tcfg is not None and self.method != "int8_weight_only" and self.layers is None:
            from tasks.quant.plan import is_skipped

            experts = [f"layers.{i}.moe.experts" for i in range(ctx.tcfg.n_layers) if ctx.tcfg.is_moe_layer(i)]
            kept = [name for name in experts if not is_skipped(name, self.skip_layers)]
            if kept:
                raise ConfigError(
                    f"model.converters: qat_int8 with quantize.method={self.method}: MoE experts ({kept[0]}) are "
                    "quantized INT8 weight-only only; set quantize.method=int8_weight_only or add 'experts' to "
                    "quantize.skip_layers"
                )

    def __repr__(self) -> str:  # each rank logs it after convert: what was fake-quantized
        if not self.swapped:
            return f"qat_int8({self.method})"
        experts = sum(isinstance(m, FakeQuantExperts) for m, _ in self.swapped)
        linear = len(self.swapped) - experts
        return f"qat_int8({self.method}: {linear} Linear" + (f", {experts} experts)" if experts else ")")

    def chosen(self, model: nn.Module) -> list[str]:
        """The names this converter fake-quantizes in `model`: the given layers, else the quantize stage's rule."""
        if self.layers is not None:
            return self.layers
        from tasks.quant.artifact import describe_layers
        from tasks.quant.plan import select_layers

        try:
            return select_layers(describe_layers(model), "torchao", None, self.method, self.skip_layers)
        except StageError as e:
            raise ConfigError(f"model.converters: qat_int8: {e}") from None

    def convert(self, model: nn.Module) -> None:
        wanted = set(self.chosen(model))
        act, weight = fake_quant_configs(self.method)
        from torchao.quantization.qat import FakeQuantizedLinear
        from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase

        from tasks.model.transformer import TiedOutput

        # A tied output projection (TiedOutput, when quantize.skip_layers lets lm_head through) computes as a plain
        # fake-quantized Linear: the same values, without TiedOutput's gradient copy.
        swaps = {nn.Linear: FakeQuantizedLinear, TiedOutput: FakeQuantizedLinear, GroupedExperts: FakeQuantExperts}
        swapped = swap_classes(model, swaps, only=wanted)
        for module, _ in swapped:
            if isinstance(module, FakeQuantizedLinear):
                # What FakeQuantizedLinear.__init__ sets; the quantizers hold no tensors (scales per forward).
                module.activation_fake_quantizer = FakeQuantizerBase.from_config(act) if act is not None else None
                module.weight_fake_quantizer = FakeQuantizerBase.from_config(weight)
                self.quantizer_attrs.append(module)
        self.swapped += swapped

    def revert(self) -> None:
        """Back to Linear and GroupedExperts (the weights, trained through the fake quantizer, stay)."""
        for module in self.quantizer_attrs:
            del module.activation_fake_quantizer, module.weight_fake_quantizer
        restore(self.swapped)
        self.swapped, self.quantizer_attrs = [], []
