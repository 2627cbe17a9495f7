"""The planner's enumeration, verdicts, rejection reasons, step-time model and table."""

from __future__ import annotations

import pytest

from tasks.planner.cluster import get_cluster
from tasks.shape import TransformerConfig
from tasks.planner.search import Problem, search, step_time
from tasks.planner.table import render

LLAMA3_70B = TransformerConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256)


def test_13b_on_one_64gb_card_is_infeasible():
    pb = Problem(get_cluster("910b", nodes=1, devices_per_node=1), None, 4096, 8, n_params=13e9)
    result = search(pb)
    assert result["plans"] == []
    [only] = result["rejected"]
    # What runs: fp32 params + grads + AdamW moments (16 B) + autocast's bf16 weight copies (2 B), + the CANN/HCCL
    # reserve (the textbook's 208 GB of mixed-precision states is model_state_bytes).
    assert only["total_bytes"] == 234e9 + 5e9
    assert only["reason"] == "needs 239.0 GB > 64 GB"


def test_70b_on_8_nodes_with_tp8_inside_and_pp_across_nodes_is_feasible():
    pb = Problem(get_cluster("910b", nodes=8), LLAMA3_70B, 4096, 64, pins={"tp": 8, "pp": 8})
    plans = search(pb)["plans"]
    assert plans, "no feasible plan"
    best = plans[0]
    assert (best["dp"], best["tp"], best["pp"]) == (1, 8, 8)
    assert best["total_bytes"] <= 64e9
    # Fused attention keeps no s×s scores, but the first stage also holds TP's whole-vocabulary embedding gradient
    # twice during its backward (DTensor has no vocab-sharded embedding backward: 2 × 4 B × 128256 × 8192 = 8.4 GB,
    # planner.memory.stage_breakdown), so the fastest plan that fits recomputes selectively.
    assert best["recompute"] == "selective"
    # With the paper's unfused attention (5as/h) 8 in-flight micro-batches fit only with recompute.
    pb.flash_attention = False
    plans = search(pb)["plans"]
    assert plans and all(p["recompute"] != "none" for p in plans)


def test_70b_does_not_fit_one_node():
    pb = Problem(get_cluster("910b", nodes=1), LLAMA3_70B, 4096, 64)
    result = search(pb)
    assert result["plans"] == []
    assert min(r["total_bytes"] for r in result["rejected"] if "total_bytes" in r) > 64e9


def test_rejection_reasons():
    shape = TransformerConfig(dim=4096, n_layers=30, n_heads=32, n_kv_heads=2, ffn_dim=11008, vocab_size=32000)
    pb = Problem(get_cluster("910b", devices_per_node=6), shape, 1024, 12)
    reasons = {r["reason"] for r in search(pb)["rejected"]}
    assert "tp 3 does not divide 32 heads" in reasons
    assert "tp 6 does not divide 32 heads" in reasons
    assert "pp 4 does not divide 30 layers" not in reasons  # 4 does not divide the world of 6: never tried
    pb = Problem(get_cluster("910b", nodes=2), shape, 1024, 16)
    reasons = {r["reason"] for r in search(pb)["rejected"]}
    assert "tp 4 does not divide 2 KV heads" in reasons
    assert "tp 16 spans nodes (8 devices per node)" in reasons
    assert not any("divide 30 layers" in r for r in reasons)  # training splits them unevenly (tasks/parallel/pp.py)
    assert "parallel.pp: 32 pipeline stages (16 × 2 virtual stages) exceed the model's 30 layers" in reasons
    assert "1f1b needs >= 2 micro-batches per rank, got 1" in reasons
    pb = Problem(
        get_cluster("910b"),
        TransformerConfig(
            dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936, tie_embeddings=True
        ),
        1000,
        16,
    )
    reasons = {r["reason"] for r in search(pb)["rejected"]}
    assert "tied embeddings need pp = 1 (pp 2)" in reasons
    # TP keeps the tied weight on every stage's one part (hidden-sharded for both uses): tp 2 is planned.
    assert any(p["tp"] == 2 and p["pp"] == 1 for p in search(pb)["plans"])
    pb = Problem(get_cluster("910b"), LLAMA3_70B, 1001, 16)
    reasons = {r["reason"] for r in search(pb)["rejected"]}
    assert "tp 2 does not divide seq len 1001 (sequence parallel)" in reasons


def test_memory_rejection_text():
    # 4.45625e9 params × 18 B (fp32 params, grads, AdamW moments + autocast's bf16 copies) = 80.2e9 bytes, + the
    # CPU runtime reserve (0.12 GB, tasks.planner.cluster.RESERVE_GB).
    pb = Problem(get_cluster("cpu-laptop", devices_per_node=1, memory_gb=64), None, 128, 1, n_params=4.45625e9)
    assert [r["reason"] for r in search(pb)["rejected"]] == ["needs 80.3 GB > 64 GB"]


def test_pins_that_cannot_fit_the_world_are_explained():
    pb = Problem(get_cluster("910b"), LLAMA3_70B, 4096, 64, pins={"dp": 3})
    [r] = search(pb)["rejected"]
    assert r["reason"] == "pinned dp 3 does not divide world 8 devices"
    pb = Problem(get_cluster("910b", nodes=16), LLAMA3_70B, 4096, 64, pins={"dp": 16, "tp": 8, "pp": 2})
    [r] = search(pb)["rejected"]  # 256 devices asked of 128: more than there are, not a divisibility problem
    assert r["reason"] == "pinned dp 16 × tp 8 × pp 2 = 256 exceeds world 128 devices"
    pb = Problem(get_cluster("910b"), LLAMA3_70B, 4096, 64, pins={"dp": 1, "tp": 2, "pp": 2})
    [r] = search(pb)["rejected"]
    assert r["reason"] == "dp 1 × tp 2 × pp 2 = 4 ≠ world 8 devices"


def test_step_time_model_by_hand():
    # Model states only: compute = 6 N tokens / (world · peak · efficiency); ZeRO-1 all-reduces fp32 gradients
    # and the owners broadcast their fp32 parameters, (d-1)/d · (2·4 + 4) N bytes.
    c = get_cluster("910b", nodes=2)
    pb = Problem(c, None, 2048, 64, n_params=3e9, zero_stages=[1], efficiency=0.5)
    [best, *_] = search(pb)["plans"]
    assert (best["dp"], best["tp"], best["pp"]) == (16, 1, 1)  # no shape: nothing favours TP or PP
    compute = 6 * 3e9 * 64 * 2048 / (16 * 313e12 * 0.5)
    assert best["compute_s"] == pytest.approx(compute)
    assert best["dp_comm_s"] == pytest.approx(15 / 16 * 3e9 * 12 / 25e9)  # crosses nodes: RoCE 25 GB/s
    # The all-reduce runs in buckets from backward hooks: what backward (2/3 of compute) cannot hide is exposed,
    # the broadcast after the update is not hidden.
    allreduce, broadcast = 15 / 16 * 3e9 * 8 / 25e9, 15 / 16 * 3e9 * 4 / 25e9
    assert best["dp_exposed_s"] == pytest.approx(max(allreduce - 2 / 3 * compute, 0) + broadcast)
    assert best["step_s"] == pytest.approx(compute + best["dp_exposed_s"])
    plans = search(Problem(c, None, 2048, 64, n_params=2e9, pins={"dp": 16}))["plans"]
    by_zero = {p["zero"]: p["dp_comm_s"] for p in plans}
    assert by_zero[0] == pytest.approx(2 * 15 / 16 * 2e9 * 4 / 25e9)  # fp32 all-reduce
    m = plans[0]["microbatches"]
    assert by_zero[3] == pytest.approx(15 / 16 * 2e9 * (4 + 2 * m * 2) / 25e9)
    three = [p for p in plans if p["zero"] == 3][0]
    assert three["dp_exposed_s"] == three["dp_comm_s"]  # FSDP's traffic is counted whole


def test_dp_overlap_exposes_at_least_the_last_bucket():
    from tasks.layout import Layout

    # A 1.5e6-parameter model on 8 ranks: 6 MB of fp32 gradients, a 1 MiB first bucket then one of the rest; its
    # backward hides the first bucket but not the last, whose all-reduce starts after backward's last gradient.
    pb = Problem(get_cluster("910b"), None, 2048, 8, n_params=1.5e6, precision="fp32")
    t = step_time(pb, Layout(dp=8, zero=0, micro_batch=1, global_batch=8))
    assert 2 / 3 * t["compute_s"] > 2 * 7 / 8 * 1024 * 1024 / 56e9
    last = 1.5e6 * 4 - 1024 * 1024
    assert t["dp_exposed_s"] == pytest.approx(2 * 7 / 8 * last / 56e9)
    assert t["dp_comm_s"] == pytest.approx(2 * 7 / 8 * 1.5e6 * 4 / 56e9)


def test_zero3_under_pp_keeps_layers_gathered():
    from tasks.layout import Layout
    from tasks.planner.memory import estimate

    shape = TransformerConfig(dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=32000)
    pb = Problem(get_cluster("a100-80g"), shape, 1024, 32)
    kw = dict(dp=4, pp=2, micro_batch=1, global_batch=32, pp_schedule="gpipe")
    z2, z3 = Layout(zero=2, **kw), Layout(zero=3, **kw)
    assert not z3.reshard_after_forward and Layout(zero=3, dp=8).reshard_after_forward
    assert step_time(pb, z3)["dp_comm_s"] == step_time(pb, z2)["dp_comm_s"]  # one all-gather per step, not 2 × m
    assert estimate(shape, 1024, z3)["total_bytes"] == estimate(shape, 1024, z2)["total_bytes"]


def test_bubble_and_comm_terms():
    from tasks.layout import Layout

    c = get_cluster("910b", nodes=2)
    pb = Problem(c, LLAMA3_70B, 4096, 64)
    one = step_time(pb, Layout(dp=1, tp=8, pp=2, pp_schedule="1f1b", micro_batch=1, microbatches=64))
    assert one["bubble"] == pytest.approx(1 / 65)  # (p-1)/(m+p-1)
    assert one["step_s"] >= one["compute_s"] / (1 - one["bubble"])
    inter = step_time(
        pb, Layout(dp=1, tp=8, pp=2, pp_schedule="interleaved1f1b", micro_batch=1, microbatches=64, virtual_stages=2)
    )
    assert inter["bubble"] == pytest.approx(1 / 129)  # (p-1)/(v·m + p-1)
    # TP all-reduce: 4 per layer and micro-batch of s·b·h·2 bytes, ring 2(t-1)/t over HCCS 56 GB/s.
    assert one["tp_comm_s"] == pytest.approx(4 * 64 * 40 * 2 * 7 / 8 * 4096 * 8192 * 2 / 56e9)
    # PP crosses nodes (tp·pp = 16 > 8): one send each way per micro-batch over RoCE 25 GB/s.
    assert one["pp_comm_s"] == pytest.approx(2 * 64 * 4096 * 8192 * 2 / 25e9)
    full = step_time(pb, Layout(dp=1, tp=8, pp=2, recompute="full", micro_batch=1, microbatches=64))
    assert full["compute_s"] > one["compute_s"] and full["tp_comm_s"] == pytest.approx(1.5 * one["tp_comm_s"])


def test_ranking_prefers_faster_then_smaller_and_table_renders():
    shape = TransformerConfig(dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=4096, vocab_size=32000)
    pb = Problem(get_cluster("a100-80g"), shape, 1024, 32)
    result = search(pb)
    steps = [float(f"{p['step_s']:.3g}") for p in result["plans"]]
    assert steps == sorted(steps)
    text = render(result, "header line", top_k=5)
    assert text.startswith("header line")
    assert f"feasible plans: {len(result['plans'])}" in text
    assert len([ln for ln in text.splitlines() if ln[:3].strip().isdigit()]) == 5


def test_the_tables_other_column_is_what_its_legend_says():
    """'other' is buffers_bytes + the reserve: without ZeRO 3 it still holds TP's whole-vocabulary embedding
    gradients (Llama-3-8B dp2 tp2 pp2 zero0 on h100: 5.2 GB against a 1 GB reserve), which the legend left out."""
    from tasks.model.config import get_preset

    c = get_cluster("h100-80g")
    pb = Problem(c, get_preset("llama3-8b"), 8192, 64, zero_stages=[0], pins={"dp": 2, "tp": 2, "pp": 2})
    result = search(pb)
    row = result["plans"][0]
    assert row["zero"] == 0 and row["buffers_bytes"] > 4 * row["reserve_bytes"] > 0
    text = render(result, "header line")
    assert "ZeRO-3 gather buffers + runtime reserve" not in text
    assert "under TP an untied embedding's whole-vocabulary gradients" in text and "FSDP's root unit" in text
