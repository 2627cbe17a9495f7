"""The packed CPU kernels for torchao's INT8 weight-only layers (tasks/quant/torchao_backend.pack_for_cpu): the same
product as torchao's own path, embeddings included, and layers the kernel cannot take left on torchao's path."""

import copy

import pytest
import torch

from tasks.model import build_model, get_preset, materialize
from tasks.quant import torchao_backend as tb
from tasks.quant.artifact import describe_layers
from tasks.quant.plan import select_layers


def _quantized(method: str = "int8_weight_only"):
    model = materialize(build_model(get_preset("debug")), "cpu", seed=0).to(torch.bfloat16).eval()
    model.init_rope()
    names = select_layers(describe_layers(model), "torchao", None, method, [])
    tb.quantize(model, method, names, [], "cpu")
    assert sorted(tb.quantized_names(model)) == sorted(names) and "tok_embeddings" in names and "output" in names
    return model, names


def test_packed_model_computes_what_torchao_computes():
    from tasks.model.generate import greedy

    ref, names = _quantized()
    packed = copy.deepcopy(ref)
    assert sorted(tb.pack_for_cpu(packed)) == sorted(names)  # every Linear (K = 64, 128) and the embedding
    assert type(packed.output).__name__ == "Int8PackedLinear"
    assert type(packed.tok_embeddings).__name__ == "Int8PackedEmbedding"
    tokens = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(tokens).float(), packed(tokens).float()
    assert (a - b).abs().max() <= 2 * 2**-8 * a.abs().max()  # BF16 rounding of one product, nothing more
    assert torch.equal(greedy(ref, tokens[:, :8], 8), greedy(packed, tokens[:, :8], 8))


def test_layers_the_kernel_cannot_take_keep_torchaos_path():
    w8a8, _ = _quantized("int8_dynamic")
    assert tb.pack_for_cpu(w8a8) == ["tok_embeddings"]  # W8A8 Linear layers quantize activations: not this kernel
    torch.manual_seed(0)
    odd = torch.nn.Sequential(torch.nn.Linear(40, 32), torch.nn.Linear(32, 8, bias=True)).to(torch.bfloat16)
    tb.quantize(odd, "int8_weight_only", ["0", "1"], [], "cpu")
    ref = copy.deepcopy(odd)
    assert tb.pack_for_cpu(odd) == ["1"]  # K = 40 is not a multiple of 16: the AVX-512 loop would read past it
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        out, want = odd(x).float(), ref(x).float()
    # bias kept; two BF16 roundings (the product, then the bias add) at the largest output's 2**-7 spacing: over 200
    # unseeded draws the worst was 1.64 * 2**-7, and the stop-44 CI drew 1.04 * 2**-7 against a one-rounding bound
    assert (out - want).abs().max() <= 2 * 2**-7 * want.abs().max()


@pytest.mark.parametrize("offset", [0, 3])
def test_packed_linear_takes_unaligned_views(offset):
    """A view into a bigger buffer (an offset the kernel's aligned loads cannot take) is copied first."""
    lin = torch.nn.Linear(64, 16, bias=False).to(torch.bfloat16)
    tb.quantize(lin_holder := torch.nn.Sequential(lin), "int8_weight_only", ["0"], [], "cpu")
    ref = copy.deepcopy(lin_holder)
    tb.pack_for_cpu(lin_holder)
    x = torch.randn(4 * 64 + offset, dtype=torch.bfloat16)[offset:].view(4, 64)
    with torch.no_grad():
        assert torch.allclose(lin_holder(x).float(), ref(x).float(), rtol=2**-7, atol=1e-3)
