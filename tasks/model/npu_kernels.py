"""NPU kernels ("fused operators" of the Ascend guides) as the model converter `npu_fused` (torchtitan-npu's
pattern): applied to the built model before any parallelism, it swaps module classes so that on an NPU

- RMSNorm runs `torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]`,
- RoPE runs `torch_npu.npu_rotary_mul(x, cos, sin)` (rotary_mode 'half' = HF's rotate_half layout, ours; x in BSND
  layout, cos/sin 1S1D),
- SwiGLU runs `torch_npu.npu_swiglu(cat([gate, up], -1), dim=-1)` (Swish of the first half times the second).

Which kernels a SoC gets (SOC_SUPPORT) comes from the op documentation shipped in the torch-npu 2.13.0 and 2.14.0
wheels (torch_npu/_op_plugin_docs.py) and Ascend/op-plugin's docs/context/ pages of the same ops:
npu_swiglu "支持的型号: Atlas A2 训练系列产品" (A2 only); npu_rotary_mul with jit_compile=False on Atlas A2/A3
(D < 896, even), with jit_compile=True also on Atlas 训练系列 (A1) but only D = 128; npu_rms_norm on A1, A2 and A3.
The series of a SoC name (`torch.npu.get_device_name()`) follows torch_npu's SoC table
(torch_npu/csrc/core/npu/NpuVariables.cpp `socVersionMap`): Ascend910A/ProA/PremiumA/ProB/910B = A1,
Ascend910B1…B4 (B2C, B4-1) = A2, Ascend910_93xx = A3. An unlisted SoC keeps the plain PyTorch modules.

Attention stays SDPA: op-plugin dispatches it to `npu_fusion_attention` on Ascend910B1 and newer SoCs; on older
parts (910A/910 ProB) there is no fused attention, and the planner's `plan.flash_attention` assumption drops too
(`tasks.device.fused_attention_available`). Parameters, their names and the state dict are untouched (only
`__class__` changes), so checkpoints are interchangeable. `model.npu_kernels: auto|off`; off = plain PyTorch. On
CPU/CUDA the converter is the identity.
"""

from __future__ import annotations

import re

import torch

from tasks.model.converters import ConvertContext, register, swap_classes
from tasks.model.transformer import Attention, FeedForward, RMSNorm

KERNELS = {"rms_norm": "npu_rms_norm", "rope": "npu_rotary_mul", "swiglu": "npu_swiglu"}
MODES = ("auto", "off")
A1_SOCS = ("Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B")


def atlas_series(soc: str) -> str:
    """'A1' | 'A2' | 'A3' for an Ascend 910 SoC name, '' for anything else (NpuVariables.cpp socVersionMap)."""
    if soc in A1_SOCS:
        return "A1"
    if re.fullmatch(r"Ascend910B[1-4].*", soc):
        return "A2"
    if re.fullmatch(r"Ascend910_93\d\d", soc):
        return "A3"
    return ""


def soc_problem(kernel: str, soc: str, head_dim: int | None) -> str | None:
    """Why `kernel` cannot run on `soc` for this head_dim (None: it can), from the op docs (module docstring)."""
    series = atlas_series(soc)
    if kernel == "rms_norm":
        return None if series else f"{soc!r} is not an Atlas A1/A2/A3 training SoC"
    if kernel == "swiglu":
        return None if series == "A2" else f"npu_swiglu supports Atlas A2 only, not {soc!r}"
    if kernel == "rope":
        if series in ("A2", "A3"):
            return None if head_dim is None or (head_dim < 896 and head_dim % 2 == 0) else f"head_dim {head_dim}"
        if series == "A1":
            return None if head_dim == 128 else f"npu_rotary_mul on {soc} needs head_dim 128, not {head_dim}"
        return f"npu_rotary_mul needs an Atlas A1/A2/A3 SoC, not {soc!r}"
    raise KeyError(kernel)


def _torch_npu():
    from tasks.device import import_torch_npu

    return import_torch_npu()


def soc_name() -> str:
    """The SoC of the current NPU, e.g. 'Ascend910B2' (torch.npu.get_device_name)."""
    from tasks.device import device_module

    return device_module("npu").get_device_name()


class NpuRMSNorm(RMSNorm):
    def forward(self, x):
        return _torch_npu().npu_rms_norm(x, self.weight, epsilon=self.eps)[0]


def npu_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d], rope [s, 2, d/2] (cos, sin) → npu_rotary_mul with [1, s, 1, d] cos/sin (BSND layout)."""
    cos = torch.cat([rope[:, 0], rope[:, 0]], dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([rope[:, 1], rope[:, 1]], dim=-1)[None, :, None, :].to(x.dtype)
    return _torch_npu().npu_rotary_mul(x, cos, sin)


class NpuRopeAttention(Attention):
    rotate = staticmethod(npu_rope)


class NpuFeedForward(FeedForward):
    def forward(self, x):
        return self.w2(_torch_npu().npu_swiglu(torch.cat([self.w1(x), self.w3(x)], dim=-1), dim=-1))


_SWAPS = {
    "rms_norm": (RMSNorm, NpuRMSNorm),
    "rope": (Attention, NpuRopeAttention),
    "swiglu": (FeedForward, NpuFeedForward),
}


def available(device_type: str, mode: str = "auto", head_dim: int | None = None) -> list[str]:
    """Which kernels the converter uses: none off the NPU or with mode off; on NPU those the installed torch_npu
    has (an older release without one keeps the plain PyTorch module) and this SoC supports for this head_dim."""
    if mode not in MODES:
        raise ValueError(f"model.npu_kernels: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "off" or device_type != "npu":
        return []
    torch_npu, soc = _torch_npu(), soc_name()
    return [k for k, op in KERNELS.items() if hasattr(torch_npu, op) and soc_problem(k, soc, head_dim) is None]


def convert(model: torch.nn.Module, device_type: str, mode: str = "auto") -> list[str]:
    """Swap in the NPU kernels (in place); returns the kernels used — [] (the model untouched) on CPU/CUDA."""
    head_dim = next((m.head_dim for m in model.modules() if isinstance(m, Attention)), None)
    use = available(device_type, mode, head_dim)
    swap_classes(model, dict(_SWAPS[k] for k in use))
    return use


@register("npu_fused")
class NpuFused:
    """The `npu_fused` converter: `convert` above with the run's device type and `model.npu_kernels`."""

    def __init__(self, ctx: ConvertContext):
        self.device_type = ctx.device_type
        self.mode = ctx.cfg.model.npu_kernels if ctx.cfg is not None else "auto"
        self.kernels: list[str] = []

    def convert(self, model) -> None:
        self.kernels = convert(model, self.device_type, self.mode)

    def __repr__(self) -> str:
        return f"npu_fused({', '.join(self.kernels) or 'identity'})"
