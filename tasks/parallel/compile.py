"""torch.compile per transformer block and of the loss (`train.compile`), torchtitan's pattern: each block compiled
after tensor parallelism and activation checkpointing and before FSDP (tasks/train/build.parallelize), so the compiled
region is the block's own computation (DTensor ops and the checkpoint included) and FSDP's all-gather /
reduce-scatter hooks stay outside it, on the module; the loss function (fp32 cast and cross-entropy) compiled as
torchtitan's "loss" component (tasks/train/build.build_step).

The block's `forward` is compiled in place rather than the module wrapped (torch.compile(module) adds an `_orig_mod.`
prefix to every parameter name), so names — seeded initialisation, DCP checkpoint keys, ZeRO-1 owners — are the same
with and without compile. All blocks share one code object, so the repeated block is traced once and the graph reused
(one compile for the model, paid in the first step; fullgraph for dense blocks: a graph break is an error, not a
silent slowdown; in mixture-of-experts blocks the MoE layer stays eager, one graph break, see apply_compile).
On CPU the compiled blocks compute short-sequence attention through SDPA's math backend, which inductor fuses
(MATH_ATTENTION_MAX_SEQ).

Backends: inductor on CPU (needs a C compiler) and CUDA; on Ascend the "npu" backend that torch_npu registers with
dynamo — torchair's GE graph compiler with its default CompilerConfig (torch_npu 2.7.1.post4 and 2.12.0,
torch_npu/dynamo/__init__.py: `_register_npu_backend(_get_default_backend(name="npu"))`, whose `_lazy_exec` calls
`torchair.get_npu_backend(compiler_config=config)` from torch_npu/dynamo/torchair/npu_fx_compiler.py; it compiles
forward and backward through AOT autograd, `_compile_graph_with_aot`). A torch_npu built without torchair registers
an eager "npu" backend and warns.
"""

from __future__ import annotations

import os
import shutil

# Inductor on CPU: up to this sequence length the compiled blocks compute attention through SDPA's math backend
# (scores, causal mask, softmax, weighted values as ops inductor fuses) instead of torch's CPU flash kernel, which
# inductor can only call as an opaque fallback (torch/_inductor/lowering.py make_fallback of
# _scaled_dot_product_flash_attention_for_cpu). Measured (torch 2.13, bf16, batch 8 × 4 heads × head dim 32, one
# thread, forward + backward, flash vs compiled math): sequence 128 15.5 vs 8.8 ms, 192 15.4 vs 15.3, 256 21.4 vs
# 23.4, 512 72 vs 131 (the math path materialises the [b, h, s, s] scores, quadratic in s). Eager keeps flash.
MATH_ATTENTION_MAX_SEQ = 128


def backend(device_type: str) -> str:
    """The torch.compile backend for a device type (module docstring)."""
    return "npu" if device_type == "npu" else "inductor"


def compile_problem(device_type: str, tp: int = 1) -> str | None:
    """Why train.compile cannot run here (one line), else None: inductor's CPU code needs a C compiler, and so does
    Triton's on CUDA; tensor
    parallelism is refused (torch 2.13: the compiled block's backward loses the DTensor placements of its boundary
    gradients — with ZeRO 2/3 the gradient norm came out 19 % low at the first step, the loss curve drifting, with
    ZeRO 0/1 backward raised "'Tensor' object has no attribute '_local_tensor'" in DTensor's redistribute)."""
    if tp > 1:
        return (
            f"train.compile: not with tensor parallelism (parallel.tp {tp}): torch's compiled DTensor blocks give "
            "wrong gradients in this release; set train.compile=false or parallel.tp=1"
        )
    if device_type == "cpu" and not (shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")):
        return (
            "train.compile: inductor compiles CPU kernels with a C++ compiler and none is on PATH (cc/gcc/g++); "
            "install one (apt-get install g++) or set train.compile=false"
        )
    # Triton (inductor's CUDA kernels) builds its driver module with $CC, else gcc, else clang, and raises "Failed to
    # find C compiler" at the first kernel otherwise (triton/runtime/build.py): a traceback after launch, not a line
    if device_type == "cuda" and not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        return (
            "train.compile: Triton builds inductor's CUDA kernels with a C compiler and none is found (CC, gcc, "
            "clang); install one (apt-get install gcc), set CC, or set train.compile=false"
        )
    return None


def math_attention(q, k, v):
    """Causal attention through SDPA's math backend for short sequences (MATH_ATTENTION_MAX_SEQ), SDPA's default
    kernel choice above: the attention of compiled blocks on CPU."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.size(-2) > MATH_ATTENTION_MAX_SEQ:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def apply_compile(model, device_type: str) -> int:
    """Compile each transformer block's forward in place; returns how many. On CPU the blocks whose attention is the
    model's own SDPA (no converter replaced it) compute it as `math_attention`."""
    import torch

    from tasks.model.transformer import Attention

    name = backend(device_type)
    for block in model.layers.values():
        attention = block.attention
        if device_type == "cpu" and type(attention).attend is Attention.attend and "attend" not in vars(attention):
            attention.attend = math_attention
        moe = block._modules.get("moe")
        if moe is not None:
            # The whole MoE layer runs eagerly, one graph break: the routed experts' token counts are data-dependent,
            # torch._grouped_mm's fake-tensor kernel accepts bf16 only where its CPU kernel also takes fp32, and the
            # routed path's host-side counts (.tolist(), int(), the statistics' float(aux)) broke a traced layer into
            # resume frames that dynamo recompiled per step's counts up to its recompile limit. Measured (dp2·ep2,
            # moe-demo): with only the experts, the routed path and MoE.count_aux eager, five graphs per block, 14
            # inductor compiles (forward, backward, and again forward under no_grad for validation); with the layer
            # eager, two graphs (before it: norms, attention, residual; after it: the residual add), 6 compiles.
            moe.forward = torch._dynamo.disable(moe.forward)
        block.forward = torch.compile(block.forward, backend=name, fullgraph=moe is None)
    return len(model.layers)


def compile_loss(loss_fn, device_type: str):
    """The loss function compiled too (torchtitan's compile components "model" and "loss"): the fp32 cast of the
    logits and the cross-entropy over the vocabulary, fused."""
    import torch

    return torch.compile(loss_fn, backend=backend(device_type), fullgraph=True)
