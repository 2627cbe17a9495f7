"""The NPU kernels converter (tasks/model/npu_kernels.py): identity on CPU/CUDA (proved here: same classes, same
parameters, bit-identical outputs and gradients), the selective-recompute keep-set picks up npu_fusion_attention
where the op is registered, and TASK_QUEUE_ENABLE=2 reaches NPU workers unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.model import build_model, materialize
from tasks.model.config import get_preset
from tasks.model import npu_kernels

REPO = Path(__file__).resolve().parent.parent


def _model():
    c = get_preset("debug")
    m = build_model(c, "meta")
    materialize(m, torch.device("cpu"), 0)
    return c, m


@pytest.mark.parametrize("device_type, mode", [("cpu", "auto"), ("cuda", "auto"), ("cpu", "off"), ("npu", "off")])
def test_converter_is_the_identity_off_the_npu(device_type, mode):
    c, model = _model()
    _, reference = _model()
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert npu_kernels.convert(model, device_type, mode) == []
    assert [type(m) for m in model.modules()] == classes
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    x = torch.randint(0, c.vocab_size, (2, 16))
    out, ref = model(x), reference(x)
    assert torch.equal(out, ref)
    out.float().pow(2).mean().backward()
    ref.float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_converter_refuses_unknown_mode_and_npu_needs_torch_npu():
    from tasks.device import BackendUnavailable

    _, model = _model()
    with pytest.raises(ValueError, match="model.npu_kernels: 'on' is not one of auto, off"):
        npu_kernels.convert(model, "cpu", "on")
    with pytest.raises(BackendUnavailable):  # no torch_npu on this host: auto on an NPU device names the cause
        npu_kernels.convert(model, "npu", "auto")


def test_swapped_classes_keep_parameter_names():
    """On NPU only __class__ changes; checkpoints stay interchangeable (same state-dict keys)."""
    _, model = _model()
    keys = list(model.state_dict())
    for plain, fused in npu_kernels._SWAPS.values():
        for m in model.modules():
            if type(m) is plain:
                m.__class__ = fused
    assert list(model.state_dict()) == keys
    assert type(model.layers["0"].feed_forward) is npu_kernels.NpuFeedForward


def test_selective_recompute_keeps_npu_fusion_attention_where_registered():
    from tasks.parallel.ac import keep_ops

    assert not any("npu" in str(op) for op in keep_ops())
    code = (
        "import torch\n"
        "lib = torch.library.Library('npu', 'DEF')\n"  # what torch_npu registers: torch.ops.npu.<op>
        "lib.define('npu_fusion_attention(Tensor q) -> Tensor')\n"
        "from tasks.parallel.ac import keep_ops\n"
        "print(sorted(str(op) for op in keep_ops() if 'npu' in str(op)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['npu.npu_fusion_attention.default']"


def test_task_queue_enable_in_npu_launch_env_unless_set(monkeypatch):
    from tasks.config import HardwareConfig
    from tasks.device import Backend, launch_env

    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    npu = Backend("npu", "hccl", 8)
    assert launch_env(npu, HardwareConfig())["TASK_QUEUE_ENABLE"] == "2"
    assert "TASK_QUEUE_ENABLE" not in launch_env(Backend("cpu", "gloo", 2), HardwareConfig())
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "1")
    assert launch_env(npu, HardwareConfig())["TASK_QUEUE_ENABLE"] == "1"


def test_fused_attention_by_soc_and_planner_assumption():
    from tasks.device import fused_attention_available

    assert fused_attention_available("Ascend910B2") and fused_attention_available("Ascend910_9392")
    assert fused_attention_available("910b") and fused_attention_available("h100-80g")
    assert not fused_attention_available("Ascend910A") and not fused_attention_available("Ascend910ProB")


# ---- the fused kernels without an NPU: reference implementations written from the op documentation ---------------
# torch-npu 2.13.0 / 2.14.0 wheels, torch_npu/_op_plugin_docs.py, and Ascend/op-plugin docs/context/
# (（beta）torch_npu-npu_rms_norm.md, -npu_rotary_mul.md, -npu_swiglu.md). Each checks the constraints its page states.

_ROPE_LAYOUTS = {  # input layout → r1/r2 shapes allowed (rotary_mode half; interleave: the first only)
    "BNSD": ("11SD", "B1SD", "BNSD"),
    "BSND": ("1S1D", "BS1D", "BSND"),
    "SBND": ("S11D", "SB1D", "SBND"),
}


class ReferenceTorchNpu:
    """Stands in for torch_npu: the three ops the npu_fused converter calls, as their documentation defines them."""

    @staticmethod
    def npu_rms_norm(self, gamma, epsilon=1e-06):
        """RmsNorm(x_i) = x_i / Rms(x) · g_i, Rms(x) = sqrt(mean_i x_i² + eps); second output 1 / Rms(x).
        self: fp16/bf16/fp32, 2-8 dims; gamma: the same dtype as self."""
        assert self.dtype in (torch.float16, torch.bfloat16, torch.float32) and 2 <= self.dim() <= 8
        assert gamma.dtype == self.dtype, f"gamma {gamma.dtype} must have self's dtype {self.dtype}"
        xf = self.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(self.dtype), rstd

    @staticmethod
    def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
        """half: x1, x2 = chunk(input, 2, -1); x_new = cat((-x2, x1), -1); interleave: pairs (2i, 2i+1);
        output = r1 · input + r2 · x_new. 4-D input (BNSD/BSND/SBND), D even and < 896, r1/r2 in [-1, 1] with a
        shape the layout allows."""
        assert input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape
        d = input.size(-1)
        assert d % 2 == 0 and d < 896 and r1.size(-1) == d
        assert rotary_mode in ("half", "interleave")

        def fits(layout, pattern):
            size = dict(zip(layout, input.shape))
            return all(r == (1 if p == "1" else size[p]) for r, p in zip(r1.shape, pattern))

        allowed = {k: v if rotary_mode == "half" else v[:1] for k, v in _ROPE_LAYOUTS.items()}
        assert any(fits(k, p) for k, ps in allowed.items() for p in ps), f"r1 {tuple(r1.shape)} for {input.shape}"
        assert r1.abs().max() <= 1 and r2.abs().max() <= 1
        if rotate is not None:
            x_new = input @ rotate
        elif rotary_mode == "half":
            x1, x2 = torch.chunk(input, 2, -1)
            x_new = torch.cat((-x2, x1), dim=-1)
        else:
            x1, x2 = input[..., ::2], input[..., 1::2]
            x_new = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return r1 * input + r2 * x_new

    @staticmethod
    def npu_swiglu(self, dim=-1):
        """swish(A) · B = A · sigmoid(A) · B, A the first half of self along dim, B the second."""
        assert self.size(dim) % 2 == 0
        a, b = torch.chunk(self, 2, dim)
        return a * torch.sigmoid(a) * b


@pytest.fixture
def fake_npu(monkeypatch):
    """npu_fused on a CPU host: torch_npu is the reference above, the SoC name is what the test sets."""
    soc = {"name": "Ascend910B2"}
    monkeypatch.setattr(npu_kernels, "_torch_npu", lambda: ReferenceTorchNpu)
    monkeypatch.setattr(npu_kernels, "soc_name", lambda: soc["name"], raising=False)
    return soc


@pytest.mark.parametrize(
    "soc, head_dim, expected",
    [
        ("Ascend910B2", 16, ["rms_norm", "rope", "swiglu"]),  # Atlas A2: all three
        ("Ascend910B4-1", 128, ["rms_norm", "rope", "swiglu"]),
        ("Ascend910_9392", 16, ["rms_norm", "rope"]),  # Atlas A3: npu_swiglu is documented for A2 only
        ("Ascend910A", 16, ["rms_norm"]),  # Atlas A1: npu_rotary_mul only with head_dim 128, no npu_swiglu
        ("Ascend910ProB", 128, ["rms_norm", "rope"]),
        ("Ascend910B", 16, ["rms_norm"]),  # torch_npu's "Ascend910B" is an A1 part, not a 910B1-4
        ("Ascend310P3", 16, []),  # not a training SoC: plain PyTorch
    ],
)
def test_fused_kernels_gated_by_soc_and_head_dim(fake_npu, soc, head_dim, expected):
    import dataclasses

    fake_npu["name"] = soc
    c = dataclasses.replace(get_preset("debug"), dim=4 * head_dim, n_heads=4, n_kv_heads=2)
    model = build_model(c, "meta")
    assert npu_kernels.convert(model, "npu", "auto") == expected
    kinds = {type(m) for m in model.modules()}
    for kernel, (plain, fused) in npu_kernels._SWAPS.items():
        assert (fused in kinds) == (kernel in expected) and (plain in kinds) == (kernel not in expected), kernel


def test_npu_fused_converter_matches_the_plain_model_in_logits_and_gradients(fake_npu):
    """Through the registry, as the trainer builds it; every swapped module computes with the reference ops."""
    from tasks.model import converters

    c, model = _model()
    _, plain = _model()
    [conv] = converters.build(["npu_fused"], converters.ConvertContext("npu", c))
    converters.apply(model, [conv])
    assert conv.kernels == ["rms_norm", "rope", "swiglu"] and repr(conv) == "npu_fused(rms_norm, rope, swiglu)"
    swapped = {type(m).__name__ for m in model.modules()}
    assert {"NpuRMSNorm", "NpuRopeAttention", "NpuFeedForward"} <= swapped
    assert not {"RMSNorm", "Attention", "FeedForward"} & swapped
    x = torch.randint(0, c.vocab_size, (2, 16))
    out, ref = model(x), plain(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.float().pow(2).mean().backward()
    ref.float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
