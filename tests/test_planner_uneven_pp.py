"""The planner accepts a pp that does not divide the layers, as training does (tasks/parallel/pp.layer_ranges splits
them unevenly: contiguous, earlier stages take the remainder): each stage's memory and the step time come from the
stages' own layer counts, and only what training refuses (more stages than layers) is refused. Function level: the
search on a shape, no training run."""

from __future__ import annotations

import argparse

import pytest

from tasks.layout import Layout, check
from tasks.planner.cluster import get_cluster
from tasks.planner.memory import rank_layers, stage_breakdown
from tasks.planner.search import Problem, search, step_time
from tasks.shape import TransformerConfig

QWEN2_7B_LIKE = dict(dim=3584, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064)  # 28 layers published


def _shape(n_layers: int) -> TransformerConfig:
    return TransformerConfig(n_layers=n_layers, **QWEN2_7B_LIKE)


def _layout(plan: dict) -> Layout:
    keys = Layout.__dataclass_fields__
    row = {k: v for k, v in plan.items() if k in keys}
    if row["pp_schedule"] == "none":
        row["pp_schedule"] = "1f1b"
    return Layout(**row)


def test_a_pinned_pp_that_does_not_divide_the_layers_is_planned_and_training_accepts_the_choice():
    shape = _shape(28)
    pb = Problem(get_cluster("910b", nodes=1, devices_per_node=6), shape, 4096, 256, pins={"pp": 3})
    result = search(pb)
    assert result["plans"], [r["reason"] for r in result["rejected"]][:5]
    assert not any("does not divide 28 layers" in r["reason"] for r in result["rejected"])
    assert {p["pp"] for p in result["plans"]} == {3}
    # Interleaved 1F1B with 3 × 2 = 6 stages of 28 layers (5, 5, 5, 5, 4, 4) trains too: planned, not refused.
    assert any(p["pp_schedule"] == "interleaved1f1b" for p in result["plans"] + result["rejected"] if "step_s" in p)
    for plan in result["plans"]:  # never a layout training (tasks.layout.check) refuses
        assert check(_layout(plan), shape, 4096, 6, "1×6 910b") == [], plan


def test_each_stage_counts_its_own_layers():
    """28 layers on pp 3 are 10, 9, 9 (train's split): the first stage's bytes are those of a 10-layer stage (30
    layers on pp 3), not of 28/3 layers; the step time is the 10-layer rank's (compute, TP and DP traffic)."""
    lay = Layout(dp=2, tp=1, pp=3, zero=2, micro_batch=1, microbatches=128, global_batch=256)
    assert [len(rank_layers(28, lay, s)) for s in range(3)] == [10, 9, 9]
    uneven, even = (stage_breakdown(_shape(n), 4096, lay, 0) for n in (28, 30))
    assert uneven == pytest.approx(even)
    last28, last27 = (stage_breakdown(_shape(n), 4096, lay, 2) for n in (28, 27))  # 9 layers each
    assert last28 == pytest.approx(last27)
    cluster = get_cluster("910b", nodes=1, devices_per_node=6)
    t28, t30 = (step_time(Problem(cluster, _shape(n), 4096, 256), lay) for n in (28, 30))
    assert t28["compute_s"] == pytest.approx(t30["compute_s"])
    assert t28["step_s"] == pytest.approx(t30["step_s"])
    t27 = step_time(Problem(cluster, _shape(27), 4096, 256), lay)  # 9 layers on every stage: faster
    assert t27["step_s"] < t28["step_s"]


def test_more_stages_than_layers_is_refused_in_one_line():
    shape = _shape(4)
    pb = Problem(get_cluster("910b", nodes=1, devices_per_node=5), shape, 1024, 10, pins={"pp": 5})
    result = search(pb)
    assert result["plans"] == []
    reasons = {r["reason"] for r in result["rejected"]}
    assert reasons == {"pp 5 exceeds the 4 layers (a pipeline stage holds at least one)"}
    # Interleaved: pp 3 × 2 virtual stages exceed 5 layers (train's own words); 1F1B / GPipe on 3 stages are planned.
    pb = Problem(get_cluster("910b", nodes=1, devices_per_node=3), _shape(5), 1024, 12, pins={"pp": 3})
    result = search(pb)
    assert result["plans"] and all(p["pp_schedule"] != "interleaved1f1b" for p in result["plans"])
    assert any("6 pipeline stages (3 × 2 virtual stages) exceed" in r["reason"] for r in result["rejected"])


def test_the_plan_stage_plans_a_pinned_uneven_pp(tmp_path):
    """`plan --set parallel.pp=3` on a 5-layer model of 3 ranks (the CLI path, in-process): planned, and training's
    own check accepts the choice (before: `no feasible plan … pp 3 does not divide 5 layers`)."""
    from tasks import layout
    from tasks.config import load_config
    from tasks.model.resolve import from_pipeline
    from tasks.runner import run_stage
    from tasks.stages.plan import add_cli_args

    sets = [
        "model.n_layers=5",
        "parallel.dp=0",
        "parallel.tp=1",
        "parallel.pp=3",
        "hardware.nproc_per_node=3",
        "train.global_batch=6",
    ]
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    c = load_config("ci-tiny", sets=sets)
    c.tracking.enabled = False
    out = run_stage("plan", c, tmp_path, args=parser.parse_args([]))
    assert out["parallel"]["pp"] == 3
    lay = layout.resolve(c, {"parallel": out["parallel"]}, 0)
    tcfg = from_pipeline(c, vocab_size=c.data.vocab_size)
    assert layout.check(lay, tcfg, c.data.seq_len, lay.world, "test") == []
