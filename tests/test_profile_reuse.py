"""What the profile stage treats as "the same profile": an earlier collect is reused only for the layout and world
size that would be launched now (a re-plan changes neither the config's digest nor the shard set), and a baseline is
only a profile of the same global batch, optimizer, compile, converters and profiler options."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from tasks.fsutil import atomic_write_json
from tasks.profiling.baseline import key_digest, profile_key
from tasks.runner import StageContext, run_stage
from tasks.stages.profile import planned_launch, reusable

FIX = Path(__file__).resolve().parent / "fixtures" / "profiling"


def plan_result(**parallel) -> dict:
    """A plan stage result as ctx.inputs["plan"] holds it (only what layouts.resolve reads)."""
    return {"parallel": {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "recompute": "none", **parallel}}


def ctx_with(tmp_path: Path, plan: dict) -> StageContext:
    return StageContext(run_dir=tmp_path, stage="profile", inputs={"plan": plan})


def write_marker(marker: Path, cfg, shard_dir: str, launch: dict, source: Path) -> None:
    """traces/collected.json as collect writes it (the layout and world from the launch spec)."""
    atomic_write_json(
        marker, {"config_hash": cfg.digest(), "shard_dir": shard_dir, "source": str(source), "backend": "cpu", **launch}
    )


def test_a_collect_is_not_reused_after_a_replan_changed_the_layout(cfg, tmp_path):
    """`plan --zero 1`, `profile`, `plan --zero 3 --recompute full`, `profile`: the second profile reused the zero-1
    traces (same config digest, same shard set), so it profiled a layout the plan no longer launches."""
    cfg.parallel.dp = 0  # the planner decides
    marker, source = tmp_path / "traces" / "collected.json", tmp_path / "traces"
    zero1 = planned_launch(cfg, ctx_with(tmp_path, plan_result(zero=1)))
    assert (zero1["layout"]["zero"], zero1["layout"]["recompute"], zero1["world"]) == (1, "none", 2)
    write_marker(marker, cfg, "/data/A", zero1, source)
    assert reusable(marker, cfg, "/data/A", **zero1) == source  # nothing changed: reused (after a JSON round trip)

    zero3 = planned_launch(cfg, ctx_with(tmp_path, plan_result(zero=3, recompute="full")))
    assert (zero3["layout"]["zero"], zero3["layout"]["recompute"]) == (3, "full")
    assert reusable(marker, cfg, "/data/A", **zero3) is None
    assert cfg.digest() == json.loads(marker.read_text())["config_hash"]  # the digest alone could not tell


def test_planned_launch_is_what_train_prepare_launches(cfg, tmp_path):
    """The reuse check compares the marker with planned_launch; the marker records train.prepare's launch spec (what
    ran). The two must agree for the same plan (else nothing is ever reused) and follow a re-plan (`plan --zero 3
    --recompute full` after zero 1: else the old layout's traces are reused)."""
    from data_prep.build import build_shard_set
    from tasks.stages import train
    from tests.helpers.shards import shard_cfg

    shards = build_shard_set(shard_cfg(tmp_path / "shards")).shard_dir
    cfg.parallel.dp = 0
    seen = []
    for plan in (plan_result(zero=1), plan_result(zero=3, recompute="full")):
        ctx = StageContext(tmp_path / "run", "profile", Namespace(shard_dir=str(shards)), {"plan": plan})
        spec = train.prepare(cfg, ctx)
        assert planned_launch(cfg, ctx) == {"layout": spec["layout"], "world": spec["world"]}
        seen.append((spec["layout"]["zero"], spec["layout"]["recompute"]))
    assert seen == [(1, "none"), (3, "full")]


def test_a_collect_is_not_reused_for_another_world_size(cfg, tmp_path):
    marker, source = tmp_path / "traces" / "collected.json", tmp_path / "traces"
    launch = planned_launch(cfg, ctx_with(tmp_path, plan_result()))
    write_marker(marker, cfg, "/data/A", launch, source)
    assert reusable(marker, cfg, "/data/A", **launch) == source
    assert reusable(marker, cfg, "/data/A", launch["layout"], launch["world"] * 2) is None


def test_a_marker_without_a_layout_is_not_reused(cfg, tmp_path):
    """A marker written before the layout was compared says nothing of what ran: collected again."""
    marker = tmp_path / "traces" / "collected.json"
    atomic_write_json(marker, {"config_hash": cfg.digest(), "shard_dir": "/data/A", "source": str(tmp_path)})
    assert reusable(marker, cfg, "/data/A", **planned_launch(cfg, ctx_with(tmp_path, plan_result()))) is None


REPORT = {"source": {"format": "torch_trace"}, "world": 2}
RAN = {"layout": {"dp": 2, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 2, "global_batch": 8, "microbatches": 0}}


@pytest.mark.parametrize(
    "change",
    [
        {"train.global_batch": 32},
        {"parallel.microbatches": 4},
        {"train.compile": True},
        {"train.optimizer": "sgd"},
        {"model.converters": []},
        {"model.npu_kernels": "off"},
        {"profile.with_stack": True},
        {"profile.profile_memory": False},
        {"profile.record_shapes": True},
    ],
    ids=lambda c: next(iter(c)),
)
def test_the_key_differs_for_a_change_that_makes_profiles_incomparable(cfg, change):
    """Each of these changes the step a profile measures. Keyed as a collect is (collected.json's model: the built
    shape, which holds no converters), and as an analysed folder (the config's)."""
    from tasks.config import apply_overrides

    ran = {"model": {"dim": 64, "n_layers": 2}}
    before = [key_digest(profile_key(cfg, REPORT, "cpu", ran)), key_digest(profile_key(cfg, REPORT, "cpu"))]
    apply_overrides(cfg, change)
    after = [key_digest(profile_key(cfg, REPORT, "cpu", ran)), key_digest(profile_key(cfg, REPORT, "cpu"))]
    assert after[0] != before[0] and after[1] != before[1]


def test_a_collected_profile_is_keyed_by_the_global_batch_that_ran(cfg):
    """A collect is keyed by the launched layout (collected.json): its global batch and micro-batch count."""
    key = profile_key(cfg, REPORT, "cpu", RAN)
    assert (key["global_batch"], key["microbatches"]) == (8, 0)
    for field, value in (("global_batch", 16), ("microbatches", 4)):
        other = profile_key(cfg, REPORT, "cpu", {"layout": {**RAN["layout"], field: value}})
        assert key_digest(other) != key_digest(key)


def test_npu_profiler_options_key_only_npu_profiles(cfg):
    cfg.profile.npu_level = "Level0"
    assert "npu_level" not in profile_key(cfg, REPORT, "cpu")["profiler"]  # ignored off an NPU: not a difference
    npu = {"source": {"format": "ascend_pt"}, "world": 2}
    before = key_digest(profile_key(cfg, npu))
    cfg.profile.npu_level = "Level2"
    assert key_digest(profile_key(cfg, npu)) != before


def test_another_global_batch_is_no_baseline_never_a_regression(cfg, tmp_path):
    """The repro: a profile at global batch 8, then one at 16 whose communication share is higher (more micro-batches
    per step) was compared with the first and raised baseline.regression."""
    cfg.tracking.experiment = f"profile-reuse-{tmp_path.name}"
    cfg.profile.fail_on_regression = True
    args = Namespace(action="analyze", path=str(FIX / "torch_cuda_healthy"), shard_dir=None)
    first = run_stage("profile", cfg, tmp_path / "a", args=args)
    assert first["baseline_run_id"] is None

    cfg.train.global_batch *= 2
    slower = tmp_path / "slower"  # the same traces, 1.5x slower: a regression if it were compared
    slower.mkdir()
    for p in (FIX / "torch_cuda_healthy").glob("*.json"):
        data = json.loads(p.read_text())
        for e in data["traceEvents"]:
            for k in ("ts", "dur"):
                if isinstance(e.get(k), (int, float)):
                    e[k] *= 1.5
        (slower / p.name).write_text(json.dumps(data))
    second = run_stage("profile", cfg, tmp_path / "b", args=Namespace(**{**vars(args), "path": str(slower)}))
    assert second["status"] == "ok" and second["baseline_run_id"] is None and second["rules"] == []
    assert "global_batch 16→32" in second["baseline_note"]
