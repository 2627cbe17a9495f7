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
