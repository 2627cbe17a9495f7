"""NPU kernels ("fused operators" of the Ascend guides) as a model converter, torchtitan-npu's pattern: applied to the
built model before any parallelism, it swaps module classes so that on an NPU

- RMSNorm runs `torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]`,
- RoPE runs `torch_npu.npu_rotary_mul(x, cos, sin)` (rotary_mode 'half' = HF's rotate_half layout, ours),
- SwiGLU runs `torch_npu.npu_swiglu(cat([gate, up], -1), dim=-1)` (Swish of the first half times the second).

Attention stays SDPA: op-plugin dispatches it to `npu_fusion_attention` on Ascend910B1 and newer SoCs; on older
parts (910A/910 ProB) there is no fused attention, and the planner's `plan.flash_attention` assumption drops too
(`tasks.device.fused_attention_available`). Parameters, their names and the state dict are untouched (only
`__class__` changes), so checkpoints are interchangeable. `model.npu_kernels: auto|off`; auto = on when the device
is an NPU and the op exists in the installed torch_npu. On CPU/CUDA the converter is the identity.
"""

from __future__ import annotations

import torch

from tasks.model.transformer import Attention, FeedForward, RMSNorm

KERNELS = {"rms_norm": "npu_rms_norm", "rope": "npu_rotary_mul", "swiglu": "npu_swiglu"}
MODES = ("auto", "off")


def _torch_npu():
    from tasks.device import import_torch_npu

    return import_torch_npu()


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


def available(device_type: str, mode: str = "auto") -> list[str]:
    """Which kernels the converter uses: none off the NPU or with mode off; on NPU those the installed torch_npu
    has (an older release without one keeps the plain PyTorch module)."""
    if mode not in MODES:
        raise ValueError(f"model.npu_kernels: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "off" or device_type != "npu":
        return []
    torch_npu = _torch_npu()
    return [k for k, op in KERNELS.items() if hasattr(torch_npu, op)]


def convert(model: torch.nn.Module, device_type: str, mode: str = "auto") -> list[str]:
    """Swap in the NPU kernels (in place); returns the kernels used — [] (the model untouched) on CPU/CUDA."""
    use = available(device_type, mode)
    for kernel in use:
        plain, fused = _SWAPS[kernel]
        for module in model.modules():
            if type(module) is plain:
                module.__class__ = fused
    return use
