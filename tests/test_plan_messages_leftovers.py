"""What the planner and the out-of-memory diagnosis tell a user (docs/stages.md, docs/real-size.md).

In-process and CPU-cheap: the plan stage through the CLI for a real preset, then the functions that word its table and
the one line after an out-of-memory failure, fed with that plan.json.
"""

from __future__ import annotations

import json
import re

import pytest

from tasks import layout as layouts
from tasks.cli import main as cli_main
from tasks.config import load_config, validate
from tasks.parallel.diagnosis import next_feasible_plan
from tasks.planner import moe, rehearsal
from tasks.units import GB


def _plan(name: str, tmp_path, capsys) -> tuple[dict, dict]:
    """The plan stage's --json result for preset `name` and the plan.json it wrote."""
    assert cli_main(["plan", "--config", name, "--run-dir", str(tmp_path / "run"), "--no-tracking", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    with open(result["plan_json"]) as f:
        return result, json.load(f)


def _layout(name: str, result: dict, sets: list[str]) -> dict:
    """The layout the train stage runs for preset `name` with these --set flags (its launch spec's `layout`)."""
    cfg = validate(load_config(name, sets=sets))
    world = cfg.hardware.nnodes * cfg.hardware.nproc_per_node
    return layouts.resolve(cfg, result, world).to_dict()


def _ran(lay: dict) -> tuple:
    """rehearsal.layout_identity of a launch layout (its micro-batch as the split's size)."""
    m = lay["microbatches"] or max(1, lay["global_batch"] // lay["dp"] // lay["micro_batch"])
    return rehearsal.layout_identity({**lay, "micro_batch": lay["global_batch"] // lay["dp"] // m})


@pytest.mark.parametrize(
    "name, failed",
    [
        ("qwen2-57b-a14b-910b", None),  # the plan's choice as is (ep from the plan)
        ("qwen2-57b-a14b-910b", 1),  # the second-ranked plan pinned: the first differs from it only in ep
        ("llama3-70b-910c", 5),  # pp 2 interleaved1f1b pinned
    ],
)
def test_the_oom_suggestion_pins_another_plan_that_fits(name, failed, tmp_path, capsys):
    # next_feasible_plan compared dp/tp/pp/zero/recompute/micro_batch only: a plan differing in ep was "the same",
    # its suggestion named no ep (nor the schedule under PP), so the --set flags could not reproduce it, and it took
    # the best-ranked plan however much memory it needs, after the layout it names ran out.
    result, doc = _plan(name, tmp_path, capsys)
    plans = doc["plans"]
    row = doc["chosen"] if failed is None else plans[failed]
    lay = _layout(name, result, [] if failed is None else rehearsal.pins(row).replace("--set ", "").split())
    assert _ran(lay) == rehearsal.layout_identity(row)  # the layout that ran is the planned row
    est = row["total_bytes"] - row["reserve_bytes"]  # the OOM file's figure on an accelerator
    text = next_feasible_plan(plans, lay, est, "npu")
    sets = re.findall(r"--set (\S+)", text)
    assert sets, text
    pinned = _layout(name, result, sets)
    assert _ran(pinned) != _ran(lay), text  # never the layout that ran out
    match = [p for p in plans if rehearsal.layout_identity(p) == _ran(pinned)]
    assert match, f"{text}: its flags pin no planned layout"
    assert match[0]["total_bytes"] - match[0]["reserve_bytes"] < est, text  # estimated below the one that ran out
    if match[0]["ep"] > 1:
        assert f"parallel.ep={match[0]['ep']}" in sets
    if match[0]["pp"] > 1:
        assert f"parallel.pp_schedule={match[0]['pp_schedule']}" in sets
    # The best-ranked such plan: every plan ranked above it either is the failed layout or needs as much memory.
    for p in plans[: plans.index(match[0])]:
        assert rehearsal.layout_identity(p) == _ran(lay) or p["total_bytes"] - p["reserve_bytes"] >= est


def test_no_suggestion_that_needs_more_than_the_layout_that_ran_out(tmp_path, capsys):
    name = "qwen2-57b-a14b-910b"
    result, doc = _plan(name, tmp_path, capsys)
    plans = doc["plans"]
    row = min(plans, key=lambda p: p["total_bytes"])  # the smallest plan: nothing else is estimated below it
    lay = _layout(name, result, rehearsal.pins(row).replace("--set ", "").split())
    est = row["total_bytes"] - row["reserve_bytes"]
    text = next_feasible_plan(plans, lay, est, "npu")
    assert "--set" not in text and f"{est / GB:.1f} GB" in text and "lower train.micro_batch" in text, text


def test_the_moe_table_says_how_many_rejections_it_leaves_out(tmp_path, capsys):
    # "rejected: 12" followed by five lines and no word of the other seven; the dense table says "… N more in
    # plan.json". One rule (tasks.planner.table.rejected_lines) for both.
    _, doc = _plan("qwen2-57b-a14b-910b", tmp_path, capsys)
    result = {"plans": doc["plans"], "rejected": doc["rejected"]}
    for k in (3, 10, 100):
        text = moe.render(result, "header", top_k=k, rejected_k=k)
        lines = text.splitlines()
        i = lines.index(f"rejected: {len(doc['rejected'])}")
        listed = [x for x in lines[i + 1 :] if not x.startswith("  …")]
        more = len(doc["rejected"]) - len(listed)
        assert (f"  … {more} more in plan.json" in lines) == (more > 0), text
        shown = len([x for x in lines[:i] if re.match(r"\s+\d+ dp", x)])
        assert shown == min(k, len(doc["plans"]))
        more = len(doc["plans"]) - shown
        assert (f"    … {more} more in plan.json" in lines) == (more > 0), text


def test_pins_name_interleaved_1f1bs_virtual_stages():
    """An interleaved plan is pinned with its chunks per rank (a config's other parallel.virtual_stages is another
    run); any other schedule is not."""
    from tasks.planner.rehearsal import pins

    plan = {"dp": 2, "tp": 1, "pp": 2, "zero": 1, "recompute": "none", "micro_batch": 1, "virtual_stages": 4}
    assert "--set parallel.virtual_stages=4" in pins({**plan, "pp_schedule": "interleaved1f1b"})
    assert "virtual_stages" not in pins({**plan, "pp_schedule": "1f1b"})
