"""Audit of the real-size route (docs/real-size.md): what a user of a 7B+ preset is told when the rehearsal stops.

In-process and CPU-cheap: the plan stage through the CLI for a real preset, the train stage's own rehearsal spec for
the layout it would run (tasks.layout.resolve of that plan), and the rehearsal's verdict on made-up measured figures.
"""

from __future__ import annotations

import json
import types

import pytest

from tasks import layout as layouts
from tasks.cli import main as cli_main
from tasks.config import load_config, validate
from tasks.planner import rehearsal
from tasks.stages import train


def _spec_as_train_builds_it(name: str, tmp_path, capsys) -> tuple[dict, dict]:
    """The plan stage's result for preset `name`, and the rehearsal spec the train stage builds for its layout."""
    run = tmp_path / "run"
    assert cli_main(["plan", "--config", name, "--run-dir", str(run), "--no-tracking", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cfg = validate(load_config(name))
    world = cfg.hardware.nnodes * cfg.hardware.nproc_per_node
    lay = layouts.resolve(cfg, result, world)
    ctx = types.SimpleNamespace(inputs={"plan": {"plan_json": result["plan_json"]}})
    est = result["best"]["total_bytes"] - result["best"]["reserve_bytes"]
    sp = train.rehearsal_spec(cfg, ctx, {"estimate_bytes": est, "backend": "npu"}, lay)
    return result, sp


@pytest.mark.parametrize("name", ["qwen2-7b-910b", "qwen2-57b-a14b-910b", "llama3-70b-910c"])
def test_the_next_feasible_plan_is_never_the_layout_that_just_failed(name, tmp_path, capsys):
    # At pp 1 the run keeps its config's parallel.pp_schedule (1f1b) while plan.json writes `none`: the layout being
    # run was not recognised among the alternatives, and a stopped rehearsal told the user to pin that very layout.
    result, sp = _spec_as_train_builds_it(name, tmp_path, capsys)
    running = rehearsal.pins(sp["chosen"])
    est, step = sp["estimate_bytes"], sp["estimate_step_s"]
    assert step > 0  # the plan chose this layout: its step time is judged
    slow = rehearsal.verdict(sp, [est * 0.9], step * 1.5)  # memory as planned, steps 50 % slower
    heavy_est = min(est, sp["capacity_bytes"] / 1.3)  # +30 % over the estimate, still under the device
    heavy = rehearsal.verdict({**sp, "estimate_bytes": heavy_est}, [heavy_est * 1.3], step)
    for v in (slow, heavy):
        assert not v["ok"]
        assert running not in v["cause"], v["cause"]
        assert f"next feasible plan {rehearsal.layout_name(sp['chosen'])} " not in v["cause"], v["cause"]


def test_a_layout_other_than_the_planned_one_is_not_judged_by_the_planned_step_time(tmp_path, capsys, monkeypatch):
    # The plan chose dp32·ep8 (13.1 s); training pinned ep2 (the plan's own table: 18.5 s, +41 %). The spec took
    # ep8's step time for the ep2 run (ep was not compared), and the rehearsal would stop a run slower only by its
    # layout, telling the user the step-time model is off.
    name = "qwen2-57b-a14b-910b"
    run = tmp_path / "run"
    assert cli_main(["plan", "--config", name, "--run-dir", str(run), "--no-tracking", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parallel"].get("ep", 8) != 2
    cfg = validate(load_config(name, sets=["parallel.ep=2"]))
    lay = layouts.resolve(cfg, result, cfg.hardware.nnodes * cfg.hardware.nproc_per_node)
    assert lay.ep == 2
    ctx = types.SimpleNamespace(inputs={"plan": {"plan_json": result["plan_json"]}})
    sp = train.rehearsal_spec(cfg, ctx, {"estimate_bytes": 40e9, "backend": "npu"}, lay)
    assert sp["chosen"]["ep"] == 2 and sp["estimate_step_s"] == 0.0
    assert rehearsal.verdict(sp, [40e9], 18.5)["ok"]
