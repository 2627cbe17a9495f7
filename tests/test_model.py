"""The model: presets, validation one-liners, parameter/FLOP counts, init determinism, pipeline/TP-shaped pieces."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tasks.errors import ConfigError
from tasks.model import (
    PRESETS,
    TransformerConfig,
    build_model,
    flops_per_token,
    from_pipeline,
    get_preset,
    lm_loss,
    materialize,
    num_params,
)


def test_presets_count_published_sizes():
    with torch.device("meta"):  # shapes only: even llama3-70b costs nothing here
        for name in PRESETS:
            tcfg = get_preset(name)
            model = build_model(tcfg)
            assert sum(p.numel() for p in model.parameters()) == num_params(tcfg), name
    billions = {n: num_params(get_preset(n)) / 1e9 for n in PRESETS}
    assert billions["llama3-8b"] == pytest.approx(8.03, abs=0.01)
    assert billions["llama3-70b"] == pytest.approx(70.55, abs=0.01)
    assert billions["qwen2-7b"] == pytest.approx(7.62, abs=0.01)
    assert billions["qwen2-0.5b"] == pytest.approx(0.494, abs=0.001)
    assert billions["llama-13b"] == pytest.approx(13.02, abs=0.01)


def test_flops_per_token_is_6n_plus_attention():
    tcfg = get_preset("llama3-8b")
    dense = 6 * (num_params(tcfg) - tcfg.vocab_size * tcfg.dim)
    attn = 12 * 32 * 32 * 128 * 2048
    assert flops_per_token(tcfg, 2048) == dense + attn


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_heads=7), "model.n_heads: 7 does not divide model.dim 128"),
        (dict(n_heads=4, n_kv_heads=3), "model.n_heads: 4 is not divisible by model.n_kv_heads 3"),
        (dict(family="gpt2"), "model.family: 'gpt2' is not one of llama, qwen2"),
    ],
)
def test_invalid_shapes_fail_in_one_line(change, message):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(get_preset("demo"), **change).validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_preset_names_known_ones(cfg):
    cfg.model.preset = "gpt-5"
    with pytest.raises(ConfigError, match=r"unknown preset 'gpt-5' \(known: debug, demo, qwen2-0.5b"):
        from_pipeline(cfg)


def test_from_pipeline_vocab_and_overrides(cfg):
    tcfg = from_pipeline(cfg, vocab_size=1999)
    assert (tcfg.dim, tcfg.vocab_size) == (128, 1999)  # small preset: the tokenizer's vocabulary
    cfg.model.preset, cfg.model.n_layers = "qwen2-0.5b", 2
    tcfg = from_pipeline(cfg, vocab_size=1999)
    assert (tcfg.vocab_size, tcfg.n_layers, tcfg.qkv_bias) == (151936, 2, True)  # published vocab kept
    cfg.model.preset, cfg.model.vocab_size = "demo", 1000
    with pytest.raises(ConfigError, match="tokenizer has 1999 tokens but the model embedding only 1000"):
        from_pipeline(cfg, vocab_size=1999)
    cfg.model.vocab_size, cfg.data.seq_len = None, 4096
    with pytest.raises(ConfigError, match=r"data.seq_len: 4096 exceeds model max_seq_len 512; set data.seq_len <= 512"):
        from_pipeline(cfg, vocab_size=1999)  # the model's own context first, stretching RoPE past it second


def test_init_is_seeded_per_parameter_name():
    tcfg = get_preset("debug")
    a = materialize(build_model(tcfg), "cpu", seed=5)
    b = materialize(build_model(tcfg), "cpu", seed=5)
    c = materialize(build_model(tcfg), "cpu", seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    # A pipeline stage holding only layer 1 gets the same layer-1 weights as the whole model.
    stage = build_model(tcfg)
    del stage.layers["0"]
    materialize(stage, "cpu", seed=5)
    assert torch.equal(stage.layers["1"].feed_forward.w2.weight, a.layers["1"].feed_forward.w2.weight)
    assert a.rope_cache.dtype == torch.float32 and "rope_cache" not in a.state_dict()


def test_a_model_on_meta_is_built_without_importing_dynamo():
    """Every rank and planning process builds the model on meta first: nn.Embedding's normal_ and the RoPE table's
    arange on a meta tensor run Python references wrapped in torch._disable_dynamo, whose first call imports
    torch._dynamo (~2.5 s of CPU per process). The meta model holds shapes only; materialize writes the table."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from tasks.model import build_model, get_preset, materialize\n"
        "from tasks.model.transformer import rope_table\n"
        "m = build_model(get_preset('moe-demo'))\n"
        "assert 'torch._dynamo' not in sys.modules, 'a meta build imported torch._dynamo'\n"
        "c = m.config\n"
        "assert m.rope_cache.is_meta and m.rope_cache.shape == (c.max_seq_len, 2, c.head_dim // 2)\n"
        "assert m.tok_embeddings.weight.is_meta and m.tok_embeddings.weight.shape == (c.vocab_size, c.dim)\n"
        "materialize(m, 'cpu')\n"
        "assert torch.equal(m.rope_cache, rope_table(c.head_dim, c.max_seq_len, c.rope_theta))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_compose_to_the_whole_model(tied):
    tcfg = dataclasses.replace(get_preset("debug"), tie_embeddings=tied)
    whole = materialize(build_model(tcfg), "cpu", seed=1)
    first, last = materialize(build_model(tcfg), "cpu", seed=1), materialize(build_model(tcfg), "cpu", seed=1)
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    tokens = torch.randint(0, tcfg.vocab_size, (2, 12))
    torch.testing.assert_close(last(first(tokens)), whole(tokens))


def test_attention_counts_local_heads_from_weights():
    """Half of wq/wk/wv rows and wo columns (what TP gives a rank) → the two partial outputs sum to the whole."""
    tcfg = TransformerConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=64, n_layers=1)
    attn = materialize(build_model(tcfg), "cpu", seed=2).layers["0"].attention
    x, rope = torch.randn(2, 10, 64), materialize(build_model(tcfg), "cpu").rope_cache[:10]
    halves = []
    for part in range(2):
        shard = build_model(tcfg, "cpu").layers["0"].attention
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                getattr(shard, name).weight = torch.nn.Parameter(getattr(attn, name).weight.chunk(2, 0)[part])
            shard.wo.weight = torch.nn.Parameter(attn.wo.weight.chunk(2, 1)[part])
        halves.append(shard(x, rope))
    torch.testing.assert_close(halves[0] + halves[1], attn(x, rope))


def test_demo_model_learns_a_repeated_batch():
    tcfg = get_preset("debug")
    model = materialize(build_model(tcfg), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, tcfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(15):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    assert losses[-1] < 0.7 * losses[0]


def test_random_init_of_any_box_is_that_box_of_the_full_tensor():
    """What a rank owning rows [a, b) × columns [c, d) draws equals the same box of the one-process init — the
    property that lets each rank initialise only its shards (FSDP rows, TP rows or columns, uneven splits)."""
    from tasks.model.init import CHUNK_ELEMS, RandomInit

    init = RandomInit(seed=3, n_layers=2, tie_embeddings=False)
    rows, cols = 3 * CHUNK_ELEMS // 256 + 5, 256  # several generator chunks and a ragged last one
    full = torch.empty(rows, cols)
    init.fill("layers.0.feed_forward.w1.weight", full, (rows, cols), (0, 0))
    assert full.std().item() == pytest.approx(0.02, rel=0.05)
    for (a, b), (c, d) in [
        ((0, rows), (0, 128)),
        ((4097, 9000), (100, 256)),
        ((rows - 3, rows), (0, 256)),
        ((17, 18), (5, 6)),
    ]:
        box = torch.empty(b - a, d - c)
        init.fill("layers.0.feed_forward.w1.weight", box, (rows, cols), (a, c))
        assert torch.equal(box, full[a:b, c:d]), ((a, b), (c, d))
    other = torch.empty(rows, cols)
    init.fill("layers.0.feed_forward.w3.weight", other, (rows, cols), (0, 0))
    assert not torch.equal(other, full)


def test_tied_output_gradient_is_the_same_and_summed_in_place():
    """TiedOutput hands autograd the output projection's weight gradient as a tensor it owns, so the embedding's
    gradient is added to it in place: the tied weight's backward holds two vocab × hidden gradients at its peak, not
    three (measured on the RSS high-water mark, in a fresh process: tests/helpers/models.py tied_output_peaks), with
    bit-identical gradients."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    code = "import json; from tests.helpers.models import tied_output_peaks; print(json.dumps(tied_output_peaks()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks["identical"] and peaks["Linear"] > 2.7 and peaks["TiedOutput"] < 2.3, peaks


def test_tied_output_computes_its_own_weight_gradient_and_copies_only_under_autocast():
    """On plain tensors TiedOutput's backward is _TiedLinear's (the linear backward's two matmuls, results returned
    as they are: no copy); under autocast it is the linear backward with _OwnGrad's copy. Gradients of the weight and
    of the input bit-identical to nn.Linear's either way. On meta (no autocast state to ask) a backward runs."""

    from torch import nn

    from tasks.model import build_model, get_preset, lm_loss, materialize
    from tasks.model.transformer import TiedOutput

    tcfg = dataclasses.replace(get_preset("debug"), tie_embeddings=True)
    model = materialize(build_model(tcfg, "meta"), "cpu", 0)
    x = torch.randint(0, tcfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def graph(fn) -> set[str]:
        seen, todo = set(), [fn]
        while todo:
            f = todo.pop()
            if f is not None and f.name() not in seen:
                seen.add(f.name())
                todo.extend(n for n, _ in f.next_functions)
        return seen

    for autocast in (False, True):
        grads = {}
        for cls in (nn.Linear, TiedOutput):
            model.output.__class__ = cls
            model.zero_grad(set_to_none=True)
            h = model.tok_embeddings(x).detach().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model.output(h)
            nodes = graph(logits.grad_fn)
            if cls is TiedOutput:
                assert ("_TiedLinearBackward" in nodes) != autocast and ("_OwnGradBackward" in nodes) == autocast, nodes
            lm_loss(logits.float(), x).backward()
            grads[cls.__name__] = (model.output.weight.grad, h.grad)
        assert all(torch.equal(a, b) for a, b in zip(grads["Linear"], grads["TiedOutput"])), autocast
    # on meta (shapes only; no autocast state to ask there) the fallback, and a backward that runs
    meta = build_model(tcfg, "meta")
    lm_loss(meta(x.to("meta")), x.to("meta")).backward()
    assert meta.output.weight.grad.shape == (tcfg.vocab_size, tcfg.dim)
