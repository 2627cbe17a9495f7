"""Per-layer forward statistics, to say where a model first went non-finite (a layer-by-layer print of each output).

Forward hooks fire as each module finishes, so the record order is computation order: the first non-finite record is
where NaN/Inf entered, and everything after it merely inherited them.
"""

from __future__ import annotations

import torch


def tensor_stats(name: str, t: torch.Tensor) -> dict:
    f = t.detach().float()
    finite = torch.isfinite(f)
    vals = f[finite]
    return {
        "layer": name,
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "min": vals.min().item() if vals.numel() else None,
        "max": vals.max().item() if vals.numel() else None,
        "mean": vals.mean().item() if vals.numel() else None,
        "nan": int(torch.isnan(f).sum()),
        "inf": int(torch.isinf(f).sum()),
        "numel": f.numel(),
    }


class LayerProbe:
    """`with LayerProbe(model) as probe: model(x)` → `probe.records` (one per module output, in compute order)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.records: list[dict] = []
        self._handles = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name):
        def record(module, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(out) and out.is_floating_point():
                rec = tensor_stats(name, out)
                rec["input_nan_inf"] = sum(
                    int((~torch.isfinite(t.detach())).sum())
                    for t in inputs
                    if torch.is_tensor(t) and t.is_floating_point()
                )
                self.records.append(rec)

        return record

    def first_non_finite(self) -> dict | None:
        return next((r for r in self.records if r["nan"] or r["inf"]), None)

    def culprit(self) -> str | None:
        """The module where NaN/Inf arose: the first non-finite one, or its parent when that one's input was already
        bad — then the values broke in the parent's own functional code (e.g. attention scores and softmax)."""
        first = self.first_non_finite()
        if first is None:
            return None
        return first["layer"].rpartition(".")[0] or first["layer"] if first["input_nan_inf"] else first["layer"]


def first_non_finite_grad(model: torch.nn.Module) -> str | None:
    """The first parameter (in module order) whose gradient holds NaN/Inf."""
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return name
    return None
