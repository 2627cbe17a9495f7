"""The rehearsal's judgement (tasks/planner/rehearsal.py) on a real plan: Qwen2-7B on one 910B node, as planned by
tasks.planner.search. The trainer (issue 24, wave 2) measures; this decides, in one line with the next feasible plan."""

from __future__ import annotations

import json

import pytest

from tasks.errors import StageError

from tasks.model.config import get_preset
from tasks.planner import rehearsal
from tasks.planner.cluster import get_cluster
from tasks.planner.search import Problem, search
from tasks.units import GB
from tests.helpers.train_fixture import configure, context, shards  # noqa: F401


@pytest.fixture(scope="module")
def spec():
    cluster = get_cluster("910b")
    result = search(Problem(cluster, get_preset("qwen2-7b"), seq_len=4096, global_batch=256))
    doc = {"chosen": result["plans"][0], "plans": result["plans"]}
    capacity = (cluster.memory_gb - cluster.reserve_gb) * GB
    return rehearsal.spec(doc, result["plans"][0]["total_bytes"] - cluster.reserve_gb * GB, capacity, 3, 0.05)


def test_within_tolerance_passes_and_logs_the_figures(spec):
    est, est_s = spec["estimate_bytes"], spec["estimate_step_s"]
    v = rehearsal.verdict(spec, [0.9 * est, 1.04 * est, est], 1.04 * est_s)
    assert v["ok"] and v["cause"] is None and v["peak_rank"] == 1
    assert v["estimate_over_measured"] == pytest.approx(1 / 1.04)
    figs = rehearsal.figures(v)
    assert figs["rehearsal.ok"] == 1.0 and figs["rehearsal.peak_gb"] == pytest.approx(1.04 * est / GB)


def test_memory_beyond_the_estimate_names_measured_estimated_and_the_next_feasible_plan(spec):
    est = spec["estimate_bytes"]
    v = rehearsal.verdict(spec, [est, 1.1 * est], spec["estimate_step_s"])
    assert not v["ok"] and "\n" not in v["cause"]
    chosen = rehearsal.layout_name(spec["chosen"])
    assert v["cause"].startswith(f"rehearsal at {chosen}: rank 1 peaked at {1.1 * est / GB:.2f} GB against the ")
    assert f"plan's {est / GB:.2f} GB estimate (+10%, beyond plan.tolerance 5%)" in v["cause"]
    alt = rehearsal.next_plan(spec, 1.1)
    assert alt is not None and alt["total_bytes"] * 1.1 <= spec["capacity_bytes"]
    assert rehearsal.layout_name(alt) != chosen and f"next feasible plan {rehearsal.layout_name(alt)}" in v["cause"]
    assert "--set parallel.dp=" in v["cause"]
    # Every better-ranked alternative would not fit at the measured ratio (or is the layout that ran).
    for p in spec["alternatives"][: spec["alternatives"].index(alt)]:
        assert p["total_bytes"] * 1.1 > spec["capacity_bytes"] or rehearsal.layout_name(p) == chosen


def test_over_the_device_slow_steps_and_nothing_left(spec):
    cap = spec["capacity_bytes"]
    over = rehearsal.verdict(spec, [1.01 * cap], spec["estimate_step_s"])
    assert not over["ok"] and f"over the {cap / GB:.2f} GB a device holds" in over["cause"]
    slow = rehearsal.verdict(spec, [spec["estimate_bytes"]], 2 * spec["estimate_step_s"])
    assert not slow["ok"] and "(+100%, beyond plan.tolerance 5%; the step-time model is off" in slow["cause"]
    huge = rehearsal.verdict(spec, [10 * spec["estimate_bytes"]], spec["estimate_step_s"])
    assert huge["cause"].endswith(
        "no other planned layout fits at the measured ratio: lower train.micro_batch or add devices"
    )


def test_figures_under_a_gigabyte_read_apart_in_megabytes(spec):
    """A 0.128 GB device and a 0.131 GB peak both rounded to "0.13 GB": the line gives figures that differ as such."""
    small = {**spec, "capacity_bytes": 0.128 * GB, "estimate_bytes": 0.1204 * GB}
    over = rehearsal.verdict(small, [0.1312 * GB], spec["estimate_step_s"])
    assert "peaked at 131.2 MB, over the 128.0 MB a device holds (the plan's estimate 120.4 MB)" in over["cause"]
    assert rehearsal.sizes(30.1 * GB, 30.104 * GB) == ["30.100 GB", "30.104 GB"]  # as many decimals as they need
    assert rehearsal.sizes(2 * GB, 2 * GB) == ["2.00 GB", "2.00 GB"]


def test_cpu_judges_what_a_rank_held_against_its_own_tolerance_and_reports_the_step_time(spec):
    """On CPU the RSS peak is checked against the device, what the rank held beyond its pre-model RSS against the
    estimate (plan.cpu_tolerance), and the step time is reported only."""
    est = spec["estimate_bytes"]
    cpu = {**spec, "tolerance": 0.08, "tolerance_key": "plan.cpu_tolerance", "judge_step_time": False}
    top = [1.15 * est, 1.15 * est]  # under the device's capacity (1.17 × the estimate)
    ok = rehearsal.verdict(cpu, top, 10 * spec["estimate_step_s"], held=[1.07 * est, 0.9 * est])
    assert ok["ok"] and ok["held_bytes"] == 1.07 * est and ok["step_estimate_over_measured"] == pytest.approx(0.1)
    bad = rehearsal.verdict(cpu, top, spec["estimate_step_s"], held=[0.9 * est, 1.1 * est])
    assert not bad["ok"] and f"rank 1 peaked at {1.1 * est / GB:.2f} GB against the plan's" in bad["cause"]
    assert "(+10%, beyond plan.cpu_tolerance 8%)" in bad["cause"]


# ---- the rehearsal in a real run: the train stage on 2 gloo ranks (tests/train_fixture.py) ---------------------------

DP2 = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2, "train.steps": 3}


@pytest.mark.slow
def test_a_run_rehearses_passes_and_records_its_figures(cfg, tmp_path, shards):
    from tasks.stages import train

    result = train.run(configure(cfg, **DP2), context(tmp_path, shards))
    got = json.loads((tmp_path / "train" / "rehearsal.json").read_text())
    assert got["ok"] and got["steps"] == 3 and len(got["peaks_per_rank"]) == 2
    base = [p - h for p, h in zip(got["peaks_per_rank"], got["held_per_rank"])]
    assert all(b > 50e6 for b in base) and all(h > 0 for h in got["held_per_rank"])  # RSS before the model, held after
    assert result["rehearsal"]["rehearsal.ok"] == 1.0 and result["rehearsal"]["cause"] is None
    assert result["rehearsal"]["rehearsal.peak_gb"] == pytest.approx(max(got["held_per_rank"]) / GB)


@pytest.mark.slow
def test_device_memory_below_the_measured_peak_stops_in_one_line(cfg, tmp_path, shards):
    """The device holds less than what a rank measured (on CPU: its RSS peak less its RSS before the model): the run
    stops at the rehearsal's last step, in one line, before that step's checkpoint; the completed ones are kept and
    nothing is exported."""
    from tasks.stages import train

    c = configure(cfg, **DP2, **{"hardware.device_memory_gb": 0.08, "train.checkpoint_every": 1})
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path, shards, no_export=False))
    msg = str(err.value)
    got = json.loads((tmp_path / "train" / "rehearsal.json").read_text())
    assert "\n" not in msg and not err.value.retryable and not got["ok"]
    top = max(got["held_per_rank"])
    assert msg.startswith("rehearsal at dp2 tp1 pp1 zero3 none mb2×2: rank ")
    # the figures in one unit, with the decimals that keep different ones apart (rehearsal.sizes): a peak measured
    # within 0.05 MB of the estimate reads 122.634 against 122.6xx, so the line's precision is the run's
    peak_t, cap_t, est_t = rehearsal.sizes(got["peak_bytes"], 0.08e9, got["estimate_bytes"])
    assert float(peak_t.removesuffix(" MB")) == pytest.approx(top / 1e6, abs=0.05) and cap_t.startswith("80.0 ")
    assert f"peaked at {peak_t}, over the {cap_t} a device holds (the plan's estimate {est_t})" in msg
    assert msg.endswith("(checkpoints kept: checkpoint step-2)")
    assert not (tmp_path / "hf").exists() and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-1",
        "step-2",
    ]
