"""MoE planner (tasks/planner/moe.py): published Qwen-MoE shapes sized on Atlas 800T A2 (910B) nodes, expert
parallelism in the search space with its constraints, memory and all-to-all terms that move the right way."""

from __future__ import annotations

import pytest

from tasks.model import get_preset
from tasks.planner.cluster import get_cluster
from tasks.units import GB
from tasks.layout import Layout
from tasks.planner.memory import num_params
from tasks.planner.moe import MoeProblem, memory, search, step_time


def _pb(preset, nodes, batch=64, **kw):
    return MoeProblem(get_cluster("910b", nodes=nodes), get_preset(preset), 4096, batch, **kw)


def test_qwen2_57b_a14b_on_four_910b_nodes_prefers_ep_inside_a_node():
    pb = _pb("qwen2-57b-a14b", 4, batch=128)
    result = search(pb)
    best = result["plans"][0]
    assert best["ep"] == 8 and best["ep_intra_node"]  # 64 experts, 8 NPUs per node: EP on the node's mesh
    assert best["total_bytes"] <= 64 * GB and 0 < best["all_to_all_share"] < 0.5
    # the same layout with EP across nodes pays the 25 GB/s RoCE link instead of the 56 GB/s HCCS mesh
    cross, inside = (
        step_time(
            pb, Layout(**{k: best[k] for k in ("zero", "recompute", "micro_batch", "microbatches")}, dp=32, ep=ep)
        )
        for ep in (32, 8)
    )
    assert cross["all_to_all_s"] > inside["all_to_all_s"]
    reasons = [r["reason"] for r in result["rejected"]]
    # ZeRO 1 under EP is a candidate (the trainer composes them) rejected by memory: the 16-bit states stay whole
    zero1_ep8 = [r for r in result["rejected"] if (r.get("ep"), r.get("zero")) == (8, 1)]
    assert zero1_ep8 and all(r["reason"].endswith("> 64 GB") for r in zero1_ep8)
    assert any(r.startswith("needs ") and r.endswith("> 64 GB") for r in reasons)
    # the whole model replicated per rank (ep 1, ZeRO-1) cannot fit: 57B × 4 B of 16-bit params + grads alone
    ep1 = [r for r in result["rejected"] if r.get("ep") == 1 and r.get("zero") == 1]
    assert ep1 and all(r["total_bytes"] > 64 * GB for r in ep1)


def test_qwen15_moe_a27b_rejects_ep_not_dividing_60_experts():
    result = search(_pb("qwen1.5-moe-a2.7b", 2))
    reasons = {r.get("ep"): r["reason"] for r in result["rejected"] if "does not divide the" in r["reason"]}
    assert reasons == {8: "ep 8 does not divide the 60 experts", 16: "ep 16 does not divide the 60 experts"}
    assert result["plans"] and all(60 % p["ep"] == 0 for p in result["plans"])


def test_all_to_all_time_is_alpha_beta_with_the_clusters_latency():
    """All-to-all time = calls × the link's per-call latency + bytes leaving / bandwidth: 5 calls and 4 token
    transfers per MoE layer and micro-batch (8 and 6 under full recompute), intra-node figures while ep fits."""
    from dataclasses import replace

    from tasks.model.config import get_preset

    sh = get_preset("moe-demo")
    base = get_cluster("cpu-laptop")
    lay = Layout(dp=2, ep=2, zero=3, recompute="none", micro_batch=4, microbatches=2)
    pb = MoeProblem(base, sh, 128, 16, precision="fp32")
    t = step_time(pb, lay)
    leaving = 4 * 128 * sh.top_k * sh.dim * 4 / 2  # one transfer of one micro-batch, half leaving the rank
    assert t["all_to_all_calls"] == sh.n_moe_layers * 2 * 5
    assert t["all_to_all_latency_s"] == pytest.approx(sh.n_moe_layers * 2 * 5 * base.intra_latency_us * 1e-6)
    assert t["all_to_all_transfer_s"] == pytest.approx(sh.n_moe_layers * 2 * 4 * leaving / (base.intra_gbps * 1e9))
    assert t["all_to_all_s"] == pytest.approx(t["all_to_all_latency_s"] + t["all_to_all_transfer_s"])
    slow = step_time(
        MoeProblem(replace(base, intra_latency_us=2 * base.intra_latency_us), sh, 128, 16, precision="fp32"), lay
    )
    assert slow["all_to_all_s"] - t["all_to_all_s"] == pytest.approx(t["all_to_all_latency_s"])
    full = step_time(pb, Layout(dp=2, ep=2, zero=3, recompute="full", micro_batch=4, microbatches=2))
    assert full["all_to_all_calls"] == sh.n_moe_layers * 2 * 8
    assert full["all_to_all_transfer_s"] == pytest.approx(t["all_to_all_transfer_s"] * 6 / 4)
    assert (
        step_time(pb, Layout(dp=2, ep=1, zero=3, recompute="none", micro_batch=4, microbatches=2))["all_to_all_s"]
        == 0.0
    )
    assert get_cluster("cpu-laptop", intra_latency_us=7.0).intra_latency_us == 7.0


def test_memory_terms():
    pb = _pb("qwen2-57b-a14b", 4)
    sh = pb.shape
    one, eight = (
        memory(pb, Layout(dp=32, ep=ep, zero=1, recompute="none", micro_batch=1, microbatches=4)) for ep in (1, 8)
    )  # the formula at ZeRO-1
    # expert optimizer states split over ep (ZeRO-1 shards them over dp / ep replicas): 12 B × experts / 32
    assert eight["optimizer_bytes"] == (num_params(sh) - sh.expert_params) * 12 / 32 + sh.expert_params * 12 / 8 / 4
    assert one["params_bytes"] - eight["params_bytes"] == sh.expert_params * 2 * (1 - 1 / 8)
    assert one["all_to_all_bytes"] == 0 < eight["all_to_all_bytes"]
    # tokens × top-k × capacity: a capacity factor of 2 doubles the routed activations and buffers
    roomy = memory(
        MoeProblem(pb.cluster, sh, 4096, 64, capacity_factor=2.0),
        Layout(dp=32, ep=8, zero=1, recompute="none", micro_batch=1, microbatches=4),
    )
    assert roomy["all_to_all_bytes"] == 2 * eight["all_to_all_bytes"]
    assert roomy["activations_bytes"] > eight["activations_bytes"]
    assert 56e9 < num_params(sh) < 58e9 and 13.5e9 < num_params(sh, active=True) < 14.5e9


def test_pins_and_batch_refusals():
    pb = _pb("moe-demo", 1, batch=8)
    pb.pins = {"dp": 4}
    assert search(pb)["rejected"][0]["reason"].startswith("pinned dp 4 ≠ world 8 devices")
    pb = _pb("moe-demo", 1, batch=12)
    assert any(r["reason"] == "dp 8 does not divide global batch 12" for r in search(pb)["rejected"])


def test_plan_stage_sizes_a_moe_preset_and_hands_ep_to_training(tmp_path, capsys):
    import json

    from tasks.cli import main
    from tasks.layout import resolve

    rc = main(
        [
            "plan",
            "--no-tracking",
            "--run-dir",
            str(tmp_path),
            "--model",
            "qwen1.5-moe-a2.7b",
            "--cluster",
            "910b",
            "--nodes",
            "2",
            "--seq-len",
            "4096",
            "--global-batch",
            "64",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parallel"]["ep"] in (2, 4) and (result["parallel"]["tp"], result["parallel"]["pp"]) == (1, 1)
    table = (tmp_path / "plan" / "plan_table.txt").read_text()
    assert "MoE: 60 experts, top-4" in table and "dp16·ep8: ep 8 does not divide the 60 experts" in table

    from tasks.config import PipelineConfig

    cfg = PipelineConfig()
    cfg.parallel.dp = 0
    assert resolve(cfg, result, 16).ep == result["parallel"]["ep"]


def test_dag_form_ep_reaches_the_moe_plan(tmp_path, capsys):
    """make run CONF='{"model_preset": "moe-demo", "ep": 2}': the form's EP pins the MoE planner's ep."""
    import json

    from tasks.cli import main
    from tasks.pipeline import overrides_from_params, param_schemas

    assert param_schemas()["ep"]["section"] == "Parallelism"
    _, sets = overrides_from_params({"model_preset": "moe-demo", "ep": 2})
    assert sets == {"model.preset": "moe-demo", "parallel.ep": 2}
    rc = main(
        [
            "plan",
            "--no-tracking",
            "--run-dir",
            str(tmp_path),
            "--json",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parallel"]["ep"] == 2 and result["parallel"]["zero"] in (1, 2, 3)  # plan.zero_stages


def test_pinned_tp_and_pp_leave_the_dp_ep_part_to_the_moe_planner(tmp_path, capsys):
    """A MoE model pinned to tp 2 (or pp 2) on 4 ranks: the planner plans dp 2 · ep 2 and hands tp/pp through."""
    import json

    from tasks.cli import main

    for axis in ("tp", "pp"):
        rc = main(
            [
                "plan",
                "--no-tracking",
                "--run-dir",
                str(tmp_path / axis),
                "--json",
                "--set",
                "model.preset=moe-demo",
                "--set",
                "hardware.nproc_per_node=4",
                "--set",
                "parallel.dp=2",
                "--set",
                f"parallel.{axis}=2",
                "--set",
                "parallel.ep=2",
            ]
        )
        assert rc == 0
        par = json.loads(capsys.readouterr().out)["parallel"]
        assert (par["dp"], par["ep"], par[axis]) == (2, 2, 2), par
