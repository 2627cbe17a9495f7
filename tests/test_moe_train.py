"""MoE training on gloo (real torchrun): FSDP over all weights including the experts, and expert parallelism (ep
carved from dp, all-to-all dispatch) alone and composed with ZeRO 0/1, pipeline and tensor parallelism reproduce the
single-process run, load-balancing loss included — per step the loss and the pre-clip gradient norm, and with plain SGD
each step's parameter update (train_fixture.SGD: the experts' 1/ep gradient scale shows there); the router statistics
reach metrics.jsonl; bad MoE layouts fail before launch in one line. The test session's strict hccl mode
(tasks/collectives.py) holds every collective to HCCL's rules: router statistics reduced as CPU float64 fail here."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.train_fixture import (
    SGD,
    assert_same_run,
    configure,
    context,
    reference_run,
    shards,  # noqa: F401
    torchrun,
    write_spec,
)

# AdamW runs train 3 steps (2 of warm-up, 1 at the cosine's peak), as many as the SGD runs: each step's loss and
# gradient norm equal the reference's (the aux loss and the router statistics are in every step).
MOE = {"model.preset": "moe-demo", "model.n_layers": 2, "train.steps": 3}
QAT = ["qat_int8"]
# The two 4-rank tests' layouts: one torchrun launch trains them all (module fixture `four_ranks`).
EP_ON_FOUR = {
    "dp4_ep2": {"parallel.dp": 4, "parallel.ep": 2},
    "dp4_ep4_zero2": {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 2},
}
EP_WITH_PP_TP = {
    "dp2_pp2_ep2": {"parallel.dp": 2, "parallel.pp": 2, "parallel.ep": 2},
    "dp2_tp2_ep2": {"parallel.dp": 2, "parallel.tp": 2, "parallel.ep": 2},
    "dp2_tp2_ep2_zero1": {
        "parallel.dp": 2,
        "parallel.tp": 2,
        "parallel.ep": 2,
        "parallel.zero": 1,
        "parallel.sequence_parallel": False,
    },
    "sgd_dp2_pp2_ep2": {**SGD, "parallel.dp": 2, "parallel.pp": 2, "parallel.ep": 2},
    "sgd_dp2_tp2_ep2": {**SGD, "parallel.dp": 2, "parallel.tp": 2, "parallel.ep": 2},
}


def _run(cfg, run_root, shards, layouts: dict, nproc: int):
    specs = {}
    for name, sets in layouts.items():
        c = configure(cfg, **{**MOE, "hardware.nproc_per_node": nproc, **sets})
        specs[name] = write_spec(c, run_root / name, shards)
    rc, out = torchrun(
        configure(cfg, **{**MOE, "hardware.nproc_per_node": nproc}),
        nproc,
        list(specs.values()),
        run_root / "torchrun.log",
    )
    logs = "\n".join(p.read_text()[-3000:] for p in run_root.glob("*/logs/rank-*.log"))
    assert rc == 0, out[-3000:] + logs
    return {name: run_root / name for name in specs}


@pytest.fixture(scope="module")
def refs(shards):
    """The single-process references, computed once for the module: AdamW and SGD over 3 steps, SGD with the
    parameters after each step."""
    from tasks.config import load_config

    adamw = reference_run(configure(load_config("demo-cpu"), **MOE), shards, 3)
    sgd = reference_run(configure(load_config("demo-cpu"), **{**MOE, **SGD}), shards, 3, params=True)
    return adamw, sgd


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, shards):
    """One 4-rank torchrun over both 4-rank tests' layouts (each launch of 4 ranks costs ~20 s of CPU)."""
    from tasks.config import load_config

    root = tmp_path_factory.mktemp("moe-four-ranks")
    cfg = load_config("demo-cpu")
    cfg.data.out_dir = str(root / "data")
    return _run(cfg, root, shards, {**EP_ON_FOUR, **EP_WITH_PP_TP}, 4)


def _check(runs: dict, refs) -> None:
    """Each run against the single-process reference of its optimizer over 3 steps: AdamW runs (loss, gradient
    norm), SGD runs (named sgd_*) with each step's parameter update too."""
    adamw, sgd = refs
    for name, run_dir in runs.items():
        if name.startswith("sgd_"):
            assert_same_run(run_dir, sgd, name, steps=range(1, 4), updates=True)
        else:
            assert_same_run(run_dir, adamw, name, steps=range(1, 4))


def _check_qat(run_dir, plain, shards) -> None:
    """The EP run with qat_int8 against one process with it (updates at step 1: later, an ulp can move a weight
    across an int8 rounding boundary, as tests/test_parallel.py measures), and that reference against the plain
    one: the experts' first update differs, so the match is not the converter ignored."""
    from tasks.config import load_config

    qat = reference_run(configure(load_config("demo-cpu"), **{**MOE, **SGD, "model.converters": QAT}), shards, 3, True)
    assert_same_run(
        run_dir, qat, "sgd_dp2_ep2_qat_int8", steps=range(1, 4), updates=True, norm_rel=3e-4, update_steps=[1]
    )
    # Both layers are MoE: each rank fake-quantizes its 2 expert groups (a run that left them plain would still match
    # a reference that left them plain, and the updates below would still differ through the Linear layers).
    assert re.search(
        r"model converters: qat_int8\(int8_weight_only: \d+ Linear, 2 experts\)",
        (run_dir / "logs" / "rank-1.log").read_text(),
    )
    for name, p in plain["params"][1].items():
        if ".experts." in name:
            want, got = p - plain["params"][0][name], qat["params"][1][name] - qat["params"][0][name]
            assert (got - want).norm() > 1e-3 * want.norm(), name


@pytest.mark.slow
def test_fsdp_and_ep2_match_single_process(cfg, tmp_path, shards, refs):
    runs = _run(
        cfg,
        tmp_path,
        shards,
        {
            "dp2": {"parallel.dp": 2},
            "dp2_zero1": {"parallel.dp": 2, "parallel.zero": 1},  # replicated parameters (tasks/parallel/dp.py)
            "dp2_ep2": {"parallel.dp": 2, "parallel.ep": 2, "train.checkpoint_every": 3},
            "dp2_ep2_zero0": {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 0},
            "dp2_ep2_zero1": {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1},
            "sgd_dp2_ep2": {**SGD, "parallel.dp": 2, "parallel.ep": 2},
            "sgd_dp2_ep2_zero0": {**SGD, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 0},
            "sgd_dp2_ep2_zero1": {**SGD, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1},
            # The qat_int8 converter under EP: each rank fake-quantizes its own experts' rows (FakeQuantExperts).
            "sgd_dp2_ep2_qat_int8": {**SGD, "parallel.dp": 2, "parallel.ep": 2, "model.converters": QAT},
        },
        2,
    )
    _check_qat(runs.pop("sgd_dp2_ep2_qat_int8"), refs[1], shards)
    _check(runs, refs)
    assert "layout dp2·ep2 coords" in (runs["dp2_ep2"] / "logs" / "rank-1.log").read_text()
    records = [json.loads(ln) for ln in (runs["dp2_ep2"] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe_aux_loss"] > 0.9 and r["moe_load_max_over_mean"] >= 1.0 for r in records)
    # every assignment counted once over the ranks: 8 sequences × 32 tokens × top-2 per layer
    assert all(sum(r["moe_tokens_per_expert"]["0"]) == 8 * 32 * 2 for r in records)


@pytest.mark.slow
def test_ep2_and_ep4_on_four_ranks_match_single_process(four_ranks, refs):
    runs = {name: four_ranks[name] for name in EP_ON_FOUR}
    _check(runs, refs)
    for name, run_dir in runs.items():
        assert f"layout {name.split('_z')[0].replace('_', '·')} coords" in (run_dir / "logs" / "rank-3.log").read_text()


@pytest.mark.slow
def test_ep_composes_with_pipeline_and_tensor_parallel(four_ranks, refs):
    """ep2 carved from dp2 inside each of two pipeline stages, and ep2 at each TP coordinate of tp2 (attention and
    shared expert TP-split, routed experts whole on both TP ranks): 4 gloo ranks, the single-process curve; the
    router statistics count every assignment once (not once per pipeline stage or TP rank)."""
    runs = {name: four_ranks[name] for name in EP_WITH_PP_TP}
    _check(runs, refs)
    for name, run_dir in runs.items():
        records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert all(sum(r["moe_tokens_per_expert"][layer]) == 8 * 32 * 2 for r in records for layer in ("0", "1"))
    assert "layout dp2·pp2·ep2 coords" in (runs["dp2_pp2_ep2"] / "logs" / "rank-3.log").read_text()
    assert "layout dp2·tp2·ep2 coords" in (runs["dp2_tp2_ep2"] / "logs" / "rank-3.log").read_text()


@pytest.mark.parametrize(
    "sets, expected",
    [
        ({"parallel.dp": 2, "parallel.ep": 3}, "parallel.ep: 3 does not divide parallel.dp 2"),
        ({"parallel.dp": 2, "parallel.ep": 2, "model.preset": "debug"}, "parallel.ep: 2 needs a mixture-of-experts"),
        (
            {"parallel.dp": 6, "parallel.ep": 3, "train.global_batch": 12},
            "parallel.ep: 3 does not divide the model's 8",
        ),
        ({"parallel.dp": 1, "parallel.tp": 3}, "parallel.tp: 3 does not divide the model's 4 heads"),
    ],
)
def test_bad_moe_layouts_fail_before_launch(cfg, tmp_path, shards, sets, expected):
    from tasks.stages import train
    from tasks.errors import ConfigError

    c = configure(cfg, **{**MOE, **sets})
    with pytest.raises(ConfigError, match=expected):
        train.prepare(c, context(tmp_path, shards))


def test_router_statistics_reduce_exactly_on_the_device_in_dtypes_hccl_takes(monkeypatch):
    """One all_reduce per dtype on the run's device: the counts as int64 (exact at any size), the aux-loss sum as
    fp32 — never fp64, which HCCL's all_reduce refuses (Ascend/pytorch ProcessGroupHCCL.cpp
    checkSupportedDataTypeOfAllReduce), nor a CPU tensor handed to a device group."""
    import torch
    import torch.distributed as dist

    from tasks.model import build_model, get_preset
    from tasks.model.moe import moe_layers
    from tasks.train import router_stats

    c = get_preset("moe-demo")
    c.n_layers = 2
    model = build_model(c, "meta")
    big = 2**53 + 2  # beyond fp32's and fp64's exact integers once summed over ranks
    for _, m in moe_layers(model):
        m.stat_tokens = torch.zeros(c.n_experts, dtype=torch.float64)
        m.stat_aux, m.stat_calls, m.stat_dropped = 0.25, 1, 3
    seen = []

    def all_reduce(t, *args, **kwargs):  # three ranks holding the same statistics; the middle one routed `big`
        seen.append((t.dtype, t.device))
        if t.dtype == torch.int64:
            t[0] = big
        t.mul_(3)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    names = [n for n, _ in moe_layers(model)]
    out = router_stats.moe_metrics([model], names, c.n_experts, tp=3, device=torch.device("cpu"))
    assert {d for d, _ in seen} == set(getattr(torch, n) for n in router_stats.ROUTER_STATS_DTYPES)
    assert all(dev == torch.device("cpu") for _, dev in seen)
    layer = names[0].removeprefix("layers.").removesuffix(".moe")
    assert int(out["moe_tokens_per_expert"][layer][0]) == big  # (3 · big) // tp, exactly
    assert out["moe_aux_loss"] == pytest.approx(0.25) and out["moe_dropped_frac"] == 6 / big
