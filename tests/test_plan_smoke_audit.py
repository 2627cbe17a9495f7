"""The plan never chooses a layout the train stage refuses, and what it cannot plan fails in one line (audit of the
smoke and plan stages: layouts, configs and presets the other plan tests do not use). In-process, tracking off."""

from __future__ import annotations

import argparse

import pytest

from tasks.errors import StageError
from tasks.runner import run_stage

TINY = [  # ci-tiny's debug model on 2 CPU ranks, dp/tp left to the planner
    "parallel.dp=0",
    "parallel.tp=0",
    "hardware.nproc_per_node=2",
]


def _plan(tmp_path, config: str, sets, **parallel) -> dict:
    """The plan stage of `config` with --set values (cfg.explicit) and `parallel` as the config file's own."""
    from tasks.config import load_config
    from tasks.stages.plan import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    c = load_config(config, sets=list(sets))
    for key, value in parallel.items():
        setattr(c.parallel, key, value)
    c.tracking.enabled = False
    return run_stage("plan", c, tmp_path, args=parser.parse_args([]))


def _train_refuses(config: str, sets, parallel: dict, **own) -> list[str]:
    """What tasks.layout.check (the train stage's own check) says of the plan's choice."""
    from tasks import layout
    from tasks.config import load_config
    from tasks.model.resolve import from_pipeline

    c = load_config(config, sets=list(sets))
    for key, value in own.items():
        setattr(c.parallel, key, value)
    lay = layout.resolve(c, {"parallel": parallel}, 0)
    tcfg = from_pipeline(c, vocab_size=c.data.vocab_size)
    return layout.check(lay, tcfg, c.data.seq_len, lay.world, "test")


def test_an_interleaved_schedule_with_fewer_micro_batches_than_stages_is_not_chosen(tmp_path):
    """Global batch 1 on pp 2: interleaved 1F1B with one micro-batch has the smallest bubble, and the plan chose it,
    while training refuses any non-GPipe schedule with fewer micro-batches than stages (tasks.layout.check)."""
    sets = [
        "model.n_layers=8",
        "parallel.dp=0",
        "parallel.tp=1",
        "parallel.pp=2",
        "train.global_batch=1",
        "train.micro_batch=1",
        "hardware.nproc_per_node=2",
    ]
    out = _plan(tmp_path, "ci-tiny", sets)
    assert out["parallel"]["pp_schedule"] == "gpipe", out["parallel"]
    assert _train_refuses("ci-tiny", sets, out["parallel"]) == []


@pytest.mark.parametrize(
    "setting, needle",
    [("train.compile=true", "train.compile"), ('model.converters=["qat_int8"]', "qat_int8")],
)
def test_a_config_that_refuses_tensor_parallelism_is_planned_without_it(tmp_path, setting, needle):
    """train.compile and the qat_int8 converter make the train stage refuse tp > 1: with pp pinned to 1 and a
    global batch of 1, tp 2 is the only layout of 2 ranks, so the plan fails in one line naming the setting (it
    chose tp 2, which train then refused)."""
    sets = [*TINY, "parallel.pp=1", "train.global_batch=1", "train.micro_batch=1"]
    assert _plan(tmp_path / "plain", "ci-tiny", sets)["parallel"]["tp"] == 2  # the only layout without the setting
    with pytest.raises(StageError, match=needle) as e:
        _plan(tmp_path / "refused", "ci-tiny", [*sets, setting])
    assert "\n" not in str(e.value)


def test_a_refused_tp_leaves_the_plan_to_dp(tmp_path):
    """With a batch dp can split, train.compile plans dp 2 instead of tensor parallelism."""
    sets = [*TINY, "parallel.pp=1", "train.global_batch=4", "train.compile=true"]
    assert _plan(tmp_path, "ci-tiny", sets)["parallel"]["tp"] == 1


MOE = ["model.preset=moe-demo", "parallel.dp=0", "parallel.pp=1", "hardware.nproc_per_node=4", "train.global_batch=4"]


@pytest.mark.parametrize(
    "tp, needle",
    [
        (4, "does not divide the model's 2 KV heads"),  # the MoE planner chose dp1 tp4, which train refuses
        (3, "pinned tp 3 × pp 1 does not divide world 4 devices"),  # it said "dp 1 does not divide …" of dp 4 // 3
    ],
)
def test_a_pinned_tp_the_moe_model_cannot_take_fails_in_one_line(tmp_path, tp, needle):
    with pytest.raises(StageError, match=needle) as e:
        _plan(tmp_path, "ci-tiny", [*MOE, f"parallel.tp={tp}"])
    assert "\n" not in str(e.value)


def test_the_rehearsals_pinning_flags_reproduce_a_pipelined_plan(tmp_path):
    """The rehearsal's one line names the next plan "with the --set flags that pin it": a pinned layout keeps the
    config's pp_schedule, so under PP the flags must name the plan's schedule (they did not: the pinned plan then
    sized the config's 1F1B, which one micro-batch on two stages cannot run, and failed)."""
    from tasks.planner.rehearsal import pins

    base = ["model.n_layers=8", "train.global_batch=1", "train.micro_batch=1", "hardware.nproc_per_node=2"]
    searched = ["parallel.dp=0", "parallel.tp=1", "parallel.pp=0"]  # tp 1: pp 2 is the only layout of 2 ranks
    chosen = _plan(tmp_path / "searched", "ci-tiny", [*base, *searched])["parallel"]
    assert chosen["pp"] == 2 and chosen["pp_schedule"] == "gpipe", chosen
    flags = pins(chosen).replace("--set ", "").split()
    again = _plan(tmp_path / "pinned", "ci-tiny", [*base, *flags])
    assert again["pinned"] and again["parallel"] == chosen


def test_the_smoke_verdict_never_prints_a_figure_as_its_limit():
    """smoke.bf16_tolerance 0 (any departure fails) printed "departs from FP32 by 0.0% (smoke.bf16_tolerance 0%)",
    and a min_drop of 0.4 % read "0.3% < smoke.min_drop 0%": the figure and the setting as they are."""
    from tasks.config import load_config
    from tasks.stages.smoke import Curve, verdict

    sets = ["smoke.steps=4", "smoke.window=2", "smoke.bf16_tolerance=0", "smoke.min_drop=0.004"]
    cfg = load_config("ci-tiny", sets=sets)
    fp32 = [4.0, 4.0, 3.988, 3.988]  # falls 0.3 %
    bf16 = [4.0, 4.0, 3.988, 3.9881]  # 0.0013 % above FP32 at the end
    problems, _ = verdict({"fp32": Curve("fp32", fp32), "bf16": Curve("bf16", bf16)}, cfg)
    fall, gap = problems[0], problems[-1]
    assert "(0.3% < smoke.min_drop 0.4%)" in fall, fall
    assert "departs from FP32 by 0.001% over steps 2-3 (smoke.bf16_tolerance 0%)" in gap, gap


def test_a_budget_no_layout_fits_names_what_to_change(tmp_path):
    """No layout fits the device memory: the one line names the closest need and what lowers it (it named the need
    alone)."""
    with pytest.raises(StageError, match=r"closest needs [\d.]+ GB > 0\.01 GB; to fit, add devices") as e:
        _plan(tmp_path, "ci-tiny", [*TINY, "hardware.device_memory_gb=0.01"])
    assert "\n" not in str(e.value)


def test_the_smoke_summary_gives_a_small_siblings_size():
    from tasks.stages.smoke import sibling_note

    assert sibling_note({"params": 139584, "derived_from": "llama3-8b"}) == " on 0.14M-param sibling of llama3-8b"
    assert sibling_note({"params": 951_000_000, "derived_from": "qwen2-7b"}) == " on 951M-param sibling of qwen2-7b"


def test_a_sibling_cap_no_candidate_passes_is_named_not_the_memory():
    """smoke.max_params below the smallest sibling: the line said "needs 0.01 GB against 5.88 GB usable" — memory
    that fits — and advised a larger device; it names the parameter cap."""
    from tasks.config import load_config
    from tasks.errors import ConfigError
    from tasks.model.resolve import from_pipeline
    from tasks.model.sibling import choose

    cfg = load_config("ci-tiny", sets=["model.preset=demo", "smoke.max_params=1e5"])
    full = from_pipeline(cfg, vocab_size=512)
    with pytest.raises(ConfigError, match=r"no sibling of demo is under smoke\.max_params 1e\+05: .* raise smoke"):
        choose(cfg, full, 512, 64)


def test_a_routing_flip_is_not_read_as_an_expert_error():
    """smoke.compare_with_cpu on a mixture of experts: BF16 routed 1 of 16 tokens to another expert and the routed
    experts' rows (sorted by expert) shifted, read as a 127 % error in `layers.1.moe.experts`; those rows are compared
    only where the routing agrees, and the flip is counted."""
    import torch

    from tasks.model.compare import compare, summary

    router = torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 2.0, 2.1, 2.01]])  # top-2: {0, 1} and {2, 3}
    flipped = router.clone()
    flipped[1, 1] = 2.02  # token 1 now takes {1, 2}: a 0.7 % change of the logits
    rows = torch.arange(12.0).view(4, 3) + 1  # 2 tokens × top-2 assignments
    ref = [("moe.router", router), ("moe.experts", rows), ("moe", torch.ones(2, 3))]
    same = compare(ref, [("moe.router", router), ("moe.experts", rows * 1.2), ("moe", torch.ones(2, 3))], 0.05)
    assert same["first_beyond"] == "moe.experts" and same["routing_differs"] == {}  # agreeing routing: compared
    cand = [("moe.router", flipped), ("moe.experts", rows.roll(1, 0)), ("moe", torch.ones(2, 3) * 1.01)]
    out = compare(ref, cand, 0.05)
    assert out["first_beyond"] is None and out["routing_differs"] == {"moe.experts": 1}, out
    out.update(device="cpu", precision="bf16")
    assert "the router sent 1 token(s) to other experts in 1 layer(s)" in summary(out)


INTERLEAVED = [
    "model.n_layers=8",
    "parallel.dp=0",
    "parallel.tp=1",
    "parallel.pp=0",
    "train.global_batch=8",
    "train.micro_batch=1",
    "hardware.nproc_per_node=4",
]


def test_an_explicit_interleaved_schedule_is_planned_with_a_pipeline(tmp_path):
    """--set parallel.pp_schedule=interleaved1f1b, pp left to the planner: training keeps the schedule, which needs
    pp >= 2, and the plan chose dp4 pp1 (no schedule to check), which train refused."""
    sets = [*INTERLEAVED, "parallel.pp_schedule=interleaved1f1b"]
    out = _plan(tmp_path, "ci-tiny", sets)["parallel"]
    assert out["pp"] >= 2 and out["pp_schedule"] == "interleaved1f1b", out
    assert _train_refuses("ci-tiny", sets, out) == []


def test_a_config_files_interleaved_schedule_is_not_handed_to_a_layout_without_pipeline(tmp_path):
    """parallel.pp_schedule interleaved1f1b in the config file (not --set: the plan may replace it) and a plan
    without PP: the plan handed training the config's interleaved schedule for pp 1, which train refuses."""
    out = _plan(tmp_path, "ci-tiny", INTERLEAVED, pp_schedule="interleaved1f1b")["parallel"]
    assert out["pp"] == 1 and out["pp_schedule"] == "1f1b", out
    assert _train_refuses("ci-tiny", INTERLEAVED, out, pp_schedule="interleaved1f1b") == []


def test_moe_degrees_over_the_world_with_microbatches_fail_in_one_line(tmp_path):
    """tp 2 × pp 2 on 2 ranks with parallel.microbatches set: a ZeroDivisionError traceback (dp 0) in the plan."""
    sets = [*MOE[:2], "hardware.nproc_per_node=2", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"]
    with pytest.raises(StageError, match=r"pinned tp 2 × pp 2 = 4 exceeds world 2 devices") as e:
        _plan(tmp_path, "ci-tiny", [*sets, "model.n_layers=8", "train.global_batch=4", "train.micro_batch=1"])
    assert "\n" not in str(e.value)
