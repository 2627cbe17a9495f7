"""The memory estimator against the published figures (ZeRO Figure 1, Korthikanti Table 2, Transformer Math 101)."""

from __future__ import annotations

import pytest

from tasks.layout import Layout
from tasks.planner.memory import (
    estimate,
    in_flight,
    layer_activation_bytes,
    model_state_bytes,
    num_params,
    state_bytes_per_param,
)
from tasks.shape import TransformerConfig


@pytest.mark.parametrize("zero,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(zero, expected_gb):
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, K = 12, Nd = 64, mixed precision (2Ψ + 2Ψ + KΨ).
    parts = model_state_bytes(7.5e9, "bf16", "adamw", zero=zero, dp=64)
    assert round(sum(parts.values()) / 1e9, 1) == expected_gb


def test_zero_paper_figure_1_exact_bytes():
    # Unrounded: (2 + 2 + 12)Ψ, 4Ψ + 12Ψ/64, 2Ψ + 14Ψ/64, 16Ψ/64.
    psi = 7.5e9
    totals = [sum(model_state_bytes(psi, "bf16", "adamw", z, 64).values()) for z in range(4)]
    assert totals == [16 * psi, 4 * psi + 12 * psi / 64, 2 * psi + 14 * psi / 64, 16 * psi / 64]


def test_seed_13b_model_states_208_gb():
    parts = model_state_bytes(13e9, "bf16", "adamw")
    assert parts == {"params_bytes": 26e9, "grads_bytes": 26e9, "optimizer_bytes": 156e9}
    assert sum(parts.values()) == 208e9


def test_bytes_per_param_by_precision_and_optimizer():
    assert state_bytes_per_param("bf16", "adamw") == (2, 2, 12)  # fp32 master + m + v
    assert state_bytes_per_param("fp16", "adamw") == (2, 2, 12)
    assert state_bytes_per_param("fp32", "adamw") == (4, 4, 8)  # the weights are the fp32 copy: m + v only
    assert state_bytes_per_param("bf16", "sgd") == (2, 2, 8)  # fp32 copy + momentum
    assert state_bytes_per_param("fp32", "sgd") == (4, 4, 4)


# Korthikanti et al. 2022, Table 2, written out from the paper's text (bytes per layer).
TABLE_2 = {
    ("none", False, False): lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    ("none", True, False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    ("none", True, True): lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
    ("selective", True, False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    ("selective", True, True): lambda s, b, h, a, t: s * b * h * 34 / t,
    ("full", False, False): lambda s, b, h, a, t: s * b * h * 2,
}
POINTS = [(2048, 1, 12288, 96, 8), (4096, 2, 4096, 32, 4), (1024, 4, 2048, 16, 2), (512, 8, 1024, 8, 1)]


@pytest.mark.parametrize("row", list(TABLE_2))
@pytest.mark.parametrize("point", POINTS)
def test_korthikanti_table_2(row, point):
    recompute, tensor_parallel, sp = row
    s, b, h, a, t = point
    t = t if tensor_parallel else 1
    got = layer_activation_bytes(s, b, h, a, t=t, sp=sp, recompute=recompute)
    assert got == pytest.approx(TABLE_2[row](s, b, h, a, t), rel=1e-12)


def test_korthikanti_gpt3_point_by_hand():
    # s=2048, b=1, h=12288, a=96, t=8: sbh = 25,165,824 and 5as/h = 80.
    kw = dict(s=2048, b=1, h=12288, a=96)
    assert layer_activation_bytes(**kw) == 25_165_824 * 114
    assert layer_activation_bytes(**kw, t=8) == 25_165_824 * 23  # 10 + 3 + 10
    assert layer_activation_bytes(**kw, t=8, sp=True) == 25_165_824 * 14.25  # 4.25 + 10
    assert layer_activation_bytes(**kw, t=8, recompute="selective") == 25_165_824 * 13
    assert layer_activation_bytes(**kw, t=8, sp=True, recompute="selective") == 25_165_824 * 4.25
    assert layer_activation_bytes(**kw, t=8, recompute="full") == 25_165_824 * 2
    # Under SP the kept layer input is sharded along the sequence too.
    assert layer_activation_bytes(**kw, t=8, sp=True, recompute="full") == 25_165_824 * 2 / 8


def test_activation_generalisations():
    s, b, h, a = 1024, 1, 4096, 32
    base = layer_activation_bytes(s, b, h, a, recompute="selective")
    assert base == s * b * h * 34
    # A gated MLP of width f keeps 4 f-wide tensors instead of GeLU's 2: +2·2·f/h per sbh at 16 bits.
    gated = layer_activation_bytes(s, b, h, a, recompute="selective", ffn=11008, gated=True)
    assert gated == pytest.approx(s * b * h * (34 - 16 + 8 * 11008 / h))
    # fp32 activations: every 16-bit tensor doubles, the 1-byte dropout masks stay.
    assert layer_activation_bytes(s, b, h, a, act_bytes=4) == s * b * h * (16 + 2 + 16 + 32 + 9 * a * s / h)


def test_in_flight_micro_batches_per_schedule():
    assert in_flight("1f1b", pp=1, microbatches=16, stage=0) == 1
    assert in_flight("gpipe", pp=4, microbatches=16, stage=0) == 16
    assert in_flight("1f1b", pp=4, microbatches=16, stage=0) == 4
    assert in_flight("1f1b", pp=4, microbatches=16, stage=3) == 1
    assert in_flight("1f1b", pp=4, microbatches=2, stage=0) == 2
    # Interleaved, first stage: p(1 + (p-1)/(p·v)) stage-equivalents (Korthikanti §4.2.3).
    for p, v in ((4, 2), (8, 4), (2, 3)):
        assert in_flight("interleaved1f1b", pp=p, microbatches=64, stage=0, virtual=v) == pytest.approx(
            p * (1 + (p - 1) / (p * v))
        )


def test_planner_sizes_the_model_package_type():
    """The planner takes tasks.shape's TransformerConfig itself (no planner-side shape type): the expert part it
    splits over ep is the built model's routed experts, the rest its other parameters."""
    import torch

    from tasks.model import build_model
    from tasks.model.config import PRESETS, get_preset

    tcfg = get_preset("moe-demo")
    with torch.device("meta"):
        params = dict(build_model(tcfg).named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".moe.experts." in n)
    assert tcfg.expert_params == experts > 0
    assert num_params(tcfg) - tcfg.expert_params == sum(p.numel() for p in params.values()) - experts
    assert 69e9 < num_params(PRESETS["llama3-70b"]) < 72e9


def test_pipeline_estimate_takes_the_worse_stage_and_adds_the_reserve():
    sh = TransformerConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
    lay = Layout(
        dp=1,
        tp=1,
        pp=4,
        pp_schedule="1f1b",
        micro_batch=1,
        microbatches=8,
        recompute="selective",
        flash_attention=False,
    )
    est = estimate(sh, 4096, lay, reserve_bytes=5e9)
    parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes", "reserve_bytes")
    assert est["total_bytes"] == pytest.approx(sum(est[k] for k in parts))
    assert est["reserve_bytes"] == 5e9
    assert est["peak_stage"] == 0  # four micro-batches in flight beat the last stage's logits
    # Eight layers of params plus the embedding: fp32 params + grads + AdamW moments (16 B) + autocast's bf16 copy.
    assert est["params_bytes"] + est["grads_bytes"] + est["optimizer_bytes"] == pytest.approx(
        18 * (8 * sh.layer_params + sh.embedding_params)
    )
    # ZeRO-3 over 8 ranks shards all model states (fp32) and adds the two-layer bf16 all-gather buffer.
    z3 = estimate(sh, 4096, Layout(dp=8, zero=3, micro_batch=1, recompute="full", flash_attention=False))
    assert z3["params_bytes"] == pytest.approx(4 * num_params(sh) / 8)
    # + FSDP2's root unit (embedding and output) gathered in bf16 with its whole fp32 gradient until backward ends.
    assert z3["buffers_bytes"] == 2 * 2 * sh.layer_params + 2 * sh.embedding_params * (2 + 4)


def test_fused_attention_and_the_projects_selective_policy_by_hand():
    # Llama-3-8B layer, s=4096, b=1, bf16: per sbh, fused attention keeps a fp32 log-sum-exp (4a/h = 1/32).
    kw = dict(s=4096, b=1, h=4096, a=32, kv=8, ffn=14336, gated=True, flash=True)
    sbh = 4096 * 4096
    assert layer_activation_bytes(**kw) == pytest.approx(sbh * (10 + 8 + 8 * 3.5 + 1 / 32))
    # Op-level selective AC keeps the block input, wo/w2 outputs (3 × 2 B) and q, k, v, attention, gate and up
    # outputs (2 B × (1 + 2·8/32 + 1 + 2·3.5)).
    assert layer_activation_bytes(**kw, recompute="selective") == pytest.approx(sbh * (6 + 2 * 9.5 + 1 / 32))
    assert layer_activation_bytes(**kw, recompute="selective", t=4, sp=True) == pytest.approx(
        sbh * (4 + 2 / 4 + (19 + 1 / 32) / 4)
    )
    # No recompute under torch SP: the all-gathered QKV and MLP inputs (2 × 2 B) stay whole; the rest is sharded.
    assert layer_activation_bytes(**kw, t=4, sp=True) == pytest.approx(sbh * (4 + (6 + 8 + 28 + 1 / 32) / 4))


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize(
    "model, cluster, nodes, seq",
    [
        ("llama3-70b", "910b", 8, 4096),
        ("qwen2-7b", "h100-80g", 2, 8192),
        ("demo", "910b", 8, 512),
        ("llama-13b", "910c", 1, 2048),
    ],
)
def test_recompute_never_increases_the_activation_estimate(model, cluster, nodes, seq, flash):
    """Property over the planner's whole search space: for every runnable layout (dp, tp, pp, SP, schedule,
    micro-batch, ZeRO), selective and full recompute keep no more activation bytes than none. (Before the fix the
    tp 8 rows of a 70B plan had selective 14 % above none: the none count sharded the all-gathered matmul inputs
    under SP, and full recompute counted the recomputed layer's input twice.)"""
    from dataclasses import replace

    from tasks.model.config import get_preset
    from tasks.planner.cluster import get_cluster
    from tasks.planner.search import Problem, candidates

    sh = get_preset(model)
    pb = Problem(
        cluster=get_cluster(cluster, nodes=nodes),
        shape=sh,
        n_params=num_params(sh),
        seq_len=seq,
        global_batch=512,
        recompute=["none"],
        flash_attention=flash,
    )
    checked = 0
    for _, why, lay in candidates(pb):
        if lay is None:
            continue
        none = estimate(sh, seq, lay)["activations_bytes"]
        for rc in ("selective", "full"):
            got = estimate(sh, seq, replace(lay, recompute=rc))["activations_bytes"]
            assert got <= none * (1 + 1e-12), f"{rc} {got / none:.3f}× none for {lay}"
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_runtime_states_per_zero_stage_are_what_tasks_parallel_runs(precision):
    """0: all whole; 1: AdamW moments / dp; 2: FSDP2 shards + gathered compute copy kept through backward;
    3: FSDP2 shards only (16 B / dp). Parameters and gradients are fp32 in every stage."""
    from tasks.planner.memory import runtime_state_bytes

    n, dp, a = 1e9, 4, {"fp32": 4, "bf16": 2}[precision]
    cast = a if precision == "bf16" else 0  # autocast's copies (stages 0/1)
    want = {0: (4 + cast, 4, 8), 1: (4 + cast, 4, 8 / dp), 2: (4 / dp + a, 4 / dp, 8 / dp), 3: (4 / dp, 4 / dp, 8 / dp)}
    for zero, (p, g, o) in want.items():
        got = runtime_state_bytes(n, precision, "adamw", zero, dp)
        assert got == pytest.approx({"params_bytes": p * n, "grads_bytes": g * n, "optimizer_bytes": o * n}), zero


def test_tied_embedding_adds_its_second_gradient():
    """A tied embedding's backward holds two vocab × hidden gradients at once (the output projection's, waiting, and
    the embedding's dense one, added to it in place; measured 2.0 vs 1.0 for either use alone): one more than the
    state counts, in the unsharded parameter's dtype, split by TP like the vocabulary."""
    from tasks.planner.memory import stage_breakdown

    def buffers(vocab=151936, tied=True, precision="fp32", **lay):
        shape = TransformerConfig(
            dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=vocab, tie_embeddings=tied
        )
        return stage_breakdown(shape, 128, Layout(**{"dp": 4, "micro_batch": 1, **lay}), 0, precision)["buffers_bytes"]

    sh = TransformerConfig(
        dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936, tie_embeddings=True
    )
    emb = sh.embedding_params
    for zero in (0, 1, 2, 3):
        # The untied root unit also counts the output projection's gathered weight and gradient, tied does not.
        root_out = emb * (4 + (4 if zero == 3 else 0)) if zero >= 2 else 0
        assert buffers(zero=zero) - (buffers(zero=zero, tied=False) - root_out) == pytest.approx(emb * 4), zero
    # Scales with the vocabulary.
    assert buffers(vocab=2 * 151936, zero=0) == pytest.approx(2 * buffers(zero=0))
    # FSDP2 mixed precision: the unsharded gradients are bf16; ZeRO 0/1 (autocast over fp32 parameters): fp32.
    assert buffers(zero=3, precision="bf16") == pytest.approx(2 * 2 * sh.layer_params + emb * (4 + 2) + emb * 2)
    assert buffers(zero=1, precision="bf16") == pytest.approx(emb * 4)


def test_cpu_training_estimate_adds_the_measured_runtime_reserve():
    """On CPU the measured peak is RSS, which holds the runtime's own 0.12 GB (tasks.planner.cluster.RESERVE_GB):
    the trainer's estimate adds it there and not on an accelerator, whose allocator never sees it."""
    from tasks.config import load_config
    from tasks.model import get_preset
    from tasks.planner.cluster import RESERVE_GB
    from tasks.stages.train import _estimate

    cfg = load_config("demo-cpu")
    lay = Layout(dp=2, zero=3, micro_batch=4, global_batch=8)
    tcfg = get_preset("demo")
    assert RESERVE_GB["cpu"] == 0.12
    assert _estimate(cfg, tcfg, lay, "cpu") - _estimate(cfg, tcfg, lay, "npu") == pytest.approx(0.12e9, abs=1)
    # plan.runtime_reserve_gb set: the plan's reserve, not the built-in one (the rehearsal quoted 0.12 GB for a plan
    # made with 0.001)
    cfg.plan.runtime_reserve_gb = 0.001
    assert _estimate(cfg, tcfg, lay, "cpu") - _estimate(cfg, tcfg, lay, "npu") == pytest.approx(0.001e9, abs=1)


def test_tp_embedding_backward_holds_the_whole_vocabulary_gradient_twice():
    """DTensor's embedding backward has no vocab-sharded strategy: under TP an untied (vocab-split) embedding builds
    the whole vocab × hidden gradient (Partial) and reduce-scatters it — two whole gradients, not split by t. A tied
    one is split along the hidden dimension: only its local second gradient."""
    from tasks.planner.memory import stage_breakdown

    for tied in (True, False):
        sh = TransformerConfig(
            dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936, tie_embeddings=tied
        )
        for zero in (0, 3):
            for tp in (2, 4):
                lay = Layout(dp=2, tp=tp, zero=zero, micro_batch=1)
                got = stage_breakdown(sh, 128, lay, 0, "fp32")["buffers_bytes"]
                layers = 2 * 4 * sh.layer_params / tp if zero == 3 else 0
                root = (
                    (sh.embedding_params / tp) * (1 if tied else 2) * (4 + (4 if zero == 3 else 0)) if zero >= 2 else 0
                )
                want = sh.embedding_params * 4 / tp if tied else 2 * sh.embedding_params * 4
                assert got - layers - root == pytest.approx(want), (tied, zero, tp)
