"""The real-size route end to end on CPU (issue 24 item 6) through `airflow dags test`: a model that does not fit
the simulated device (hardware.device_memory_gb) — smoke trains a derived sibling, plan shards the real model over 4
ranks, the rehearsal at that layout passes, train runs it, profile profiles that layout, and export, quantize and
evaluate run on its export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tests.helpers.dags import FAIL_GB, LEAN, NO_PROBE, dags_test, preset_file, shared_failing_rehearsal_run

ROUTE = {  # ci-tiny with the demo model, 4 gloo ranks, each "device" 0.22 GB (the demo needs more on one)
    "hardware": {"nproc_per_node": 4, "device_memory_gb": 0.22} | NO_PROBE,
    "model": {"preset": "demo"},
    "parallel": {},  # the planner chooses
    "train": {"precision": "fp32", "steps": 2, "global_batch": 8, "micro_batch": 2, "checkpoint_every": 2}
    | LEAN["train"],
    "smoke": {"steps": 6, "memory_margin": 0.4},
    "evaluate": LEAN["evaluate"],
}


@pytest.mark.slow
def test_a_model_too_big_for_one_device_goes_the_whole_route(tmp_path, airflow_db):
    preset = preset_file(tmp_path / "route.yaml", ROUTE)
    out = dags_test("llm_pipeline", {}, tmp_path, extra_env={"LLM_PIPELINE_PRESET": str(preset)}, timeout=1500)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    run_dir = next((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    res = {
        s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("smoke", "plan", "train", "profile", "quantize")
    }
    res["evaluate"] = json.loads((run_dir / "evaluate.json").read_text())

    sibling = res["smoke"]["smoke_model"]
    assert sibling["derived_from"] == "demo" and sibling["hidden"] * sibling["layers"] < 128 * 4, sibling  # demo: 128×4
    plan = json.loads((run_dir / "plan" / "plan.json").read_text())["chosen"]
    assert plan["dp"] * plan["tp"] * plan["pp"] == 4 and (plan["tp"] > 1 or plan["pp"] > 1 or plan["zero"] > 0)
    # the profile is keyed (its baseline) by the layout that ran, the plan's, not the config's dp 0 tp 0 pp 0
    key = json.loads((run_dir / "profile" / "report.json").read_text())["baseline_key"]
    assert {k: key[k] for k in ("dp", "tp", "pp", "zero")} == {k: plan[k] for k in ("dp", "tp", "pp", "zero")}, key
    rehearsal = json.loads((run_dir / "train" / "rehearsal.json").read_text())
    assert rehearsal["ok"] and len(rehearsal["peaks_per_rank"]) == 4 and res["train"]["rehearsal"]["rehearsal.ok"]
    assert max(rehearsal["held_per_rank"]) <= 0.22e9 and res["train"]["steps"] == ROUTE["train"]["steps"]
    assert res["quantize"]["model_dir"] == res["evaluate"]["model_dir"] == res["train"]["hf_dir"]
    assert all(r["status"] in ("ok", "warn") for r in res.values()), {s: r["summary"] for s, r in res.items()}
    # hardware.collective_probe false: the env stage ran its checks but not the torchrun probe, and said so
    env = json.loads((run_dir / "env" / "env.json").read_text())
    skipped = [c["detail"] for c in env["checks"] if c["name"] == "allreduce"]
    assert skipped == ["collective probe skipped (hardware.collective_probe false)"] and "probe" not in env, skipped


BEFORE_TRAIN = ("env.json", "shard.json", "smoke.json", "plan.json", "plan/plan.json")


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory, airflow_db):
    """The session's llm_pipeline run of FAILING (tests/helpers/dags.py), shared with test_pipeline_e2e."""
    return shared_failing_rehearsal_run(tmp_path_factory)


@pytest.mark.slow
def test_a_failing_rehearsal_stops_the_dag_at_train_in_one_line_and_loses_nothing(failing_run):
    """ci-tiny on a device of FAIL_GB (tests/helpers/dags.py FAILING): the plan fits it, the rehearsal does not."""
    from data_prep.manifest import check_files, check_tokenizer, digest, load_manifest
    from tasks.parallel import checkpoint as ckpt

    tmp_path, out = failing_run.tmp, failing_run.out
    log = out.stdout + out.stderr
    run_dir = next((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    train = json.loads((run_dir / "train.json").read_text())
    rehearsal = json.loads((run_dir / "train" / "rehearsal.json").read_text())

    # The train task failed with the rehearsal's one line: the device, the measured and the estimated figures.
    cause = train["error"]
    assert train["status"] == "failed" and "\n" not in cause and not rehearsal["ok"], log[-4000:]
    top = max(rehearsal["held_per_rank"])
    assert cause.startswith("rehearsal at dp2 tp1 pp1 zero3 none mb2×1: rank "), cause
    from tasks.planner.rehearsal import sizes  # the figures' decimals are the run's: as many as keep them apart

    peak_t, cap_t, est_t = sizes(rehearsal["peak_bytes"], FAIL_GB * 1e9, rehearsal["estimate_bytes"])
    assert float(peak_t.removesuffix(" MB")) == pytest.approx(top / 1e6, abs=0.05)
    assert float(cap_t.removesuffix(" MB")) == pytest.approx(FAIL_GB * 1e3)
    assert f"peaked at {peak_t}, over the {cap_t} a device holds (the plan's estimate {est_t})" in cause
    assert cause.endswith("(checkpoints kept: checkpoint step-2)") and rehearsal["steps"] == 3, cause
    assert FAIL_GB * 1e9 < top < 2 * FAIL_GB * 1e9  # the device is just below what a rank held
    # The run's first error-level log line (the train task's; the stages before it passed) is the cause.
    errors = [line for line in log.splitlines() if re.search(r"\[error\s*\]", line)]
    assert errors and cause in errors[0], errors[:3] or log[-4000:]
    notes = [json.loads(line) for line in (tmp_path / "var" / "notifications.jsonl").read_text().splitlines()]
    assert [(n["stage"], n["cause"]) for n in notes] == [("train", cause)]
    # The plan passed (its estimate fit the device); only the measurement did not.
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["status"] in ("ok", "warn") and json.loads((run_dir / "smoke.json").read_text())["status"] == "ok"
    assert rehearsal["estimate_bytes"] < FAIL_GB * 1e9 < top

    # Nothing after train ran; nothing exported.
    assert not [s for s in ("profile", "quantize", "evaluate") if (run_dir / f"{s}.json").exists()]
    assert not (run_dir / "hf").exists()
    # The checkpoints before the rehearsal's verdict are complete and verify; none of the judged step, no partial one.
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1", "step-2"]
    assert [ckpt.verify(p) for _, p in ckpt.complete_checkpoints(ckpts)] == [None, None]
    assert ckpt.latest_verified(ckpts) == ((2, ckpts / "step-2"), [])
    # Everything completed before train is intact and was not written again once train started.
    started = (run_dir / "train" / "launch.json").stat().st_mtime_ns
    shard_dir = Path(json.loads((run_dir / "shard.json").read_text())["shard_dir"])
    earlier = [run_dir / name for name in BEFORE_TRAIN] + [p for p in shard_dir.rglob("*") if p.is_file()]
    assert all(p.stat().st_mtime_ns < started for p in earlier), [p for p in earlier if p.stat().st_mtime_ns >= started]
    manifest = load_manifest(shard_dir)
    check_tokenizer(shard_dir, manifest)
    for split in ("train", "val"):
        check_files(shard_dir, manifest, split, sha256=True)
    assert digest(shard_dir) == json.loads((run_dir / "shard.json").read_text())["manifest_digest"]
