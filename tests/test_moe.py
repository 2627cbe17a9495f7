"""Mixture of experts (tasks/model/moe.py): parity with transformers' Qwen2MoeForCausalLM both ways (single file,
sharded import, in-job DCP export), grouped vs loop expert computation, capacity, the load-balancing loss."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tasks.errors import ConfigError, StageError  # noqa: E402
from tasks.model import build_model, get_preset, materialize, num_params  # noqa: E402
from tasks.model.hf_io import load_hf, save_hf  # noqa: E402
from tasks.model.moe import MoE, collect_stats, set_aux_scale, summarise  # noqa: E402

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
)
CASES = {
    "norm-topk-all-sparse": dict(norm_topk_prob=True),
    "softmax-topk-dense-layer-1": dict(norm_topk_prob=False, mlp_only_layers=[1]),
    "sparse-step-2-six-experts": dict(
        norm_topk_prob=False, decoder_sparse_step=2, num_experts=6, num_experts_per_tok=3
    ),
}
TOKENS = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_model(extra):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(**{**SHAPE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits the router and biases: random values so routing and mapping are tested
        for name, p in model.named_parameters():
            if name.endswith(("bias", "mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_hf_import_export_parity(case, tmp_path):
    import transformers

    hf = _hf_model(CASES[case])
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
    ours = load_hf(tmp_path / "hf").eval()
    c = ours.config
    assert (c.family, c.n_experts, c.top_k) == ("qwen2_moe", hf.config.num_experts, hf.config.num_experts_per_tok)
    moe_layers = [i for i in range(c.n_layers) if "moe" in ours.layers[str(i)]._modules]
    assert moe_layers == [i for i in range(c.n_layers) if type(hf.model.layers[i].mlp).__name__.endswith("MoeBlock")]
    assert 0 < len(moe_layers)
    with torch.no_grad():
        got = ours(TOKENS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    save_hf(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, want, atol=1e-4, rtol=1e-4)


def test_ours_to_hf_from_random_init(tmp_path):
    """Our seeded init → HF directory → transformers gives our logits (the other direction's start point)."""
    import transformers

    tcfg = get_preset("moe-demo")
    tcfg.vocab_size, tcfg.n_layers, tcfg.mlp_only_layers, tcfg.norm_topk_prob = 256, 3, [2], True
    ours = materialize(build_model(tcfg), "cpu", seed=3).eval()
    with torch.no_grad():  # make the router decisive (0.02-std init gives near-uniform, tie-prone routing)
        for name, p in ours.named_parameters():
            if name.endswith(("router.weight", "shared_gate.weight", "bias")):
                p.normal_(0, 0.5)
        want = ours(TOKENS)
    save_hf(ours, tmp_path / "hf")
    names = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert names["architectures"] == ["Qwen2MoeForCausalLM"] and names["mlp_only_layers"] == [2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, want, atol=1e-4, rtol=1e-4)
    assert sum(p.numel() for p in hf.parameters()) == num_params(tcfg)


def test_sharded_import_and_missing_expert(tmp_path):
    hf = _hf_model(CASES["softmax-topk-dense-layer-1"])
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    # The HF source reads boxes: an expert block [1:3] of a stacked weight comes from experts 1 and 2 only.
    from tasks.model.init import HFWeights

    src = HFWeights(tmp_path / "hf")
    dest = torch.empty(2, 32, 64)
    src.fill("layers.0.moe.experts.w1", dest, (4, 32, 64), (1, 0, 0))
    torch.testing.assert_close(dest, torch.stack([hf.model.layers[0].mlp.experts.gate_up_proj[j, :32] for j in (1, 2)]))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "hf")(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=1e-4)
    del index["weight_map"]["model.layers.2.mlp.experts.3.up_proj.weight"]
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(StageError, match=r"lacks 1 tensors, first 'model\.layers\.2\.mlp\.experts\.3\.up_proj"):
        load_hf(tmp_path / "hf")


def test_export_from_dcp_checkpoint(tmp_path):
    """The training job's streamed export writes one HF tensor per expert that transformers loads."""
    import transformers
    import torch.distributed.checkpoint as dcp

    from tasks.model.hf_export import export_from_checkpoint

    hf = _hf_model(CASES["norm-topk-all-sparse"])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    dcp.save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    out = export_from_checkpoint(tmp_path / "step-1", ours.config, tmp_path / "export", file_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 2
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, hf(TOKENS).logits, atol=1e-4, rtol=1e-4)


def _moe_model(seed=0, **kw):
    tcfg = get_preset("moe-demo")
    tcfg.vocab_size = 256
    for k, v in kw.items():
        setattr(tcfg, k, v)
    return materialize(build_model(tcfg), "cpu", seed=seed)


def test_grouped_mm_matches_loop_forward_and_backward():
    from tasks.model.moe import GroupedExperts, grouped_ok

    model = _moe_model()
    assert grouped_ok(torch.zeros(1, 128), model.layers["0"].moe.experts.w1)  # the path under test does run here
    results = []
    for grouped in (True, False):
        GroupedExperts.use_grouped_mm = grouped
        try:
            model.zero_grad()
            loss = model(TOKENS).float().pow(2).mean()
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        finally:
            GroupedExperts.use_grouped_mm = True
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_capacity_factor_drops_and_large_capacity_is_dropless():
    base = _moe_model().eval()
    with torch.no_grad():
        want = base(TOKENS)
    collect_stats([base])
    roomy = _moe_model(capacity_factor=8.0).eval()
    tight = _moe_model(capacity_factor=0.25).eval()
    with torch.no_grad():
        torch.testing.assert_close(roomy(TOKENS), want)
        assert not torch.allclose(tight(TOKENS), want)
    stats = collect_stats([tight])
    assigned = TOKENS.numel() * 2 * 4  # tokens × top-k × layers
    cap = math.ceil(0.25 * TOKENS.numel() * 2 / 8)
    assert stats["dropped"] >= assigned - cap * 8 * 4 > 0
    assert 0 < summarise(**stats)["moe_dropped_frac"] < 1


def test_aux_loss_matches_hf_formula_and_reaches_the_router():
    """One sequence, one layer: our loss equals transformers' load_balancing_loss_func; its gradient (× coef) is
    added to the router's; the trainer's statistics report it."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    model = _moe_model(n_layers=1, aux_loss_coef=0.5)
    moe = model.layers["0"].moe
    x = torch.randn(1, 24, 128, generator=torch.Generator().manual_seed(2))
    logits = moe.router(x.view(-1, 128))
    probs, _, top_i = moe.route(x.view(-1, 128))
    ours = moe.aux_loss(probs, top_i, 1)
    want = load_balancing_loss_func((logits,), 8, 2)
    torch.testing.assert_close(ours, want.float())

    grads = []
    for coef in (0.0, 0.5):
        moe.aux_loss_coef = coef
        model.zero_grad()
        moe(x).sum().backward()
        grads.append(moe.router.weight.grad.clone())
    model.zero_grad()
    moe.aux_loss(*[t for t in (moe.route(x.view(-1, 128))[0], top_i)], 1).backward()
    torch.testing.assert_close(grads[1] - grads[0], 0.5 * moe.router.weight.grad, atol=1e-5, rtol=1e-4)
    set_aux_scale(model, 0.25)
    assert moe.aux_scale == 0.25
    stats = summarise(**collect_stats([model]))
    assert stats["moe_aux_loss"] == pytest.approx(float(ours.detach()), rel=1e-5)
    assert stats["moe_load_max_over_mean"] >= 1.0


def test_aux_loss_is_per_sequence_so_batch_splits_agree():
    """The mean of per-half losses (two dp ranks or micro-batches) equals the whole batch's."""
    moe = _moe_model(n_layers=1).layers["0"].moe
    x = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(5))
    whole = moe.aux_loss(*_route(moe, x), 4)
    halves = [moe.aux_loss(*_route(moe, h), 2) for h in x.chunk(2)]
    torch.testing.assert_close(whole, torch.stack(halves).mean())


def _route(moe, x):
    probs, _, top_i = moe.route(x.reshape(-1, x.shape[-1]))
    return probs, top_i


def test_presets_and_config_refusals():
    a27 = get_preset("qwen1.5-moe-a2.7b")
    # Published sizes: 14.3B parameters, 2.7B activated (Qwen1.5-MoE-A2.7B model card); 57B / 14B for Qwen2.
    assert 14.2e9 < num_params(a27) < 14.4e9 and 2.6e9 < num_params(a27, active=True) < 2.8e9
    q57 = get_preset("qwen2-57b-a14b")
    assert 57e9 < num_params(q57) < 58e9 and 13.5e9 < num_params(q57, active=True) < 14.5e9
    assert isinstance(build_model(get_preset("moe-demo")).layers["0"].moe, MoE)
    bad = get_preset("moe-demo")
    bad.top_k = 9
    with pytest.raises(ConfigError, match="model.top_k: 9 must be between 1 and model.n_experts 8"):
        bad.validate()
    dense = get_preset("demo")
    dense.n_experts = 4
    with pytest.raises(ConfigError, match="needs family qwen2_moe"):
        dense.validate()


def test_expert_imbalance_rule_and_all_to_all_is_communication(tmp_path):
    from tasks.profiling.model import categorize
    from tasks.profiling.moe_rules import expert_imbalance

    for name in ("c10d::alltoall_base_", "gloo:all_to_all", "hcom_alltoallv_", "record_param_comms"):
        assert categorize(name) == "communication"
    path = tmp_path / "metrics.jsonl"
    even = {"0": [10, 10, 10, 10], "1": [12, 8, 10, 10]}
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "moe_tokens_per_expert": even}) + "\n" for s in (1, 2)))
    assert expert_imbalance(path) == []
    skewed = {"0": [10, 10, 10, 10], "1": [31, 3, 3, 3]}
    with path.open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 1.0, "moe_tokens_per_expert": skewed}) + "\n")
    [finding] = expert_imbalance(path)
    assert finding["rule"] == "moe.expert_imbalance" and finding["evidence"]["layer"] == "1"
    assert finding["evidence"]["expert"] == 0
    assert finding["evidence"]["max_over_mean"] == pytest.approx(4 * 55 / 120)
    assert expert_imbalance(path, max_over_mean=2.0) == []
    assert expert_imbalance(tmp_path / "none.jsonl") == []


def test_int8_weight_only_quantizes_the_experts_and_reloads(tmp_path):
    """The quantize stage's torchao path: experts are a layer (GroupedExperts) quantized INT8 weight-only per row
    beside the Linear layers; the state dict reloads onto a meta skeleton as load_quantized does."""
    from tasks.quant.artifact import describe_layers
    from tasks.quant.plan import select_layers
    from tasks.quant.torchao_backend import quantize, quantized_names

    model = _moe_model(n_layers=2).eval()
    with torch.no_grad():
        want = model(TOKENS)
    layers = describe_layers(model)
    assert ("layers.0.moe.experts", "GroupedExperts", (8, 128, 128)) in [(x.name, x.type, x.shape) for x in layers]
    names = select_layers(
        layers, "torchao", "llm", "int8_weight_only", ["output", "tok_embeddings", "router", "shared_gate"]
    )
    with pytest.raises(StageError, match="quantized INT8 weight-only only"):
        select_layers(layers, "torchao", "llm", "int8_dynamic", ["output", "tok_embeddings"])
    quantize(model, "int8_weight_only", names, [], "cpu")
    assert sorted(quantized_names(model)) == sorted(names) and "layers.1.moe.experts" in names
    with torch.no_grad():
        got = model(TOKENS)
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    torch.save(model.state_dict(), tmp_path / "q.pt")
    back = build_model(model.config, "meta")
    back.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True), assign=True)
    back.init_rope("cpu")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(TOKENS), got)


def test_qat_fake_quantizes_and_converts_the_experts():
    """QAT (when PTQ misses the gate) treats the experts as PTQ does: fake-quantized int8 per row while it
    fine-tunes (straight-through: the weights move), INT8 tensors after convert — never left in full precision."""
    from tasks.quant.artifact import describe_layers
    from tasks.quant.plan import select_layers
    from tasks.quant.qat import torchao_qat
    from tasks.quant.torchao_backend import quantized_names

    model = _moe_model(n_layers=2)
    names = select_layers(
        describe_layers(model),
        "torchao",
        "llm",
        "int8_weight_only",
        ["output", "tok_embeddings", "router", "shared_gate"],
    )
    before = model.layers["0"].moe.experts.w1.detach().clone()
    batches = iter([(TOKENS[:, :-1], TOKENS[:, 1:])] * 3)
    model, losses = torchao_qat(model, "int8_weight_only", names, 2, batches, 1e-3, 0.0, 1.0, torch.bfloat16, "cpu")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert sorted(quantized_names(model)) == sorted(names) and "layers.0.moe.experts" in names
    w1 = model.layers["0"].moe.experts.w1
    assert type(w1).__module__.startswith("torchao") and w1.qdata.dtype == torch.int8
    assert not torch.equal(w1.dequantize().float(), before.bfloat16().float())  # fine-tuned, then quantized
    with torch.no_grad():
        assert torch.isfinite(model.eval()(TOKENS).float()).all()


def test_kv_cache_decoding_runs_the_moe_blocks():
    """Evaluation's greedy decoding (tasks/model/generate.py) goes through the MoE blocks: the cached prefill's
    logits equal the model's forward, and the continuation equals argmax decoding without a cache."""
    from tasks.model.generate import forward_cached, greedy

    model = _moe_model(n_layers=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(forward_cached(model, TOKENS, {}, 0), model(TOKENS), atol=1e-4, rtol=1e-4)
        seq = TOKENS[:, :8]
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(greedy(model, TOKENS[:, :8], 4), seq[:, 8:])


def test_router_statistics_count_once_under_full_recompute():
    """Activation checkpointing re-runs the MoE forward inside backward: tokens are counted once, and the gradient
    (aux loss included) equals the one without recompute."""
    from tasks.parallel.ac import apply_ac

    plain, ckpt = _moe_model(n_layers=2), _moe_model(n_layers=2)
    apply_ac(ckpt, "full", 1)
    grads = []
    for model in (plain, ckpt):
        collect_stats([model])
        model(TOKENS).float().pow(2).mean().backward()
        stats = collect_stats([model])
        assert all(float(t.sum()) == TOKENS.numel() * 2 for t in stats["tokens"].values())
        assert stats["calls"] == 2
        grads.append(
            model.layers["1"].moe.router.weight.grad
            if hasattr(model.layers["1"], "moe")
            else model.layers["1"]._checkpoint_wrapped_module.moe.router.weight.grad
        )
    torch.testing.assert_close(grads[0], grads[1])
