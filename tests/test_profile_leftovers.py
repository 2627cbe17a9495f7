"""Profile stage leftovers: torch's own gzip traces (`tensorboard_trace_handler(use_gzip=True)` writes
`<worker>.<ns>.pt.trace.json.gz`) were passed over by `profile analyze`; a change of an analysis-only setting
(profile.analyzer, the regression settings) collected the whole profiled run again; the MoE expert-load figure summed
the skipped and warm-up steps' routing with the recorded ones."""

from __future__ import annotations

import gzip
import json
import shutil
from argparse import Namespace
from pathlib import Path

import pytest

from tasks.config import apply_overrides
from tasks.errors import StageError
from tasks.profiling.collect import active_steps, trace_path
from tasks.profiling.loader import load_profile
from tasks.runner import StageContext
from tasks.stages import profile as stage

FIX = Path(__file__).resolve().parent / "fixtures" / "profiling" / "torch_cuda_healthy"


def _torch_gzip_traces(out: Path, ranks=(0, 1)) -> list[Path]:
    """Traces torch itself writes with use_gzip=True, one per rank (worker_name rank<r>), CPU activity only."""
    import torch
    import torch.profiler as tp

    for rank in ranks:
        handler = tp.tensorboard_trace_handler(str(out), worker_name=f"rank{rank}", use_gzip=True)
        schedule = tp.schedule(wait=0, warmup=1, active=2, repeat=1)
        with tp.profile(activities=[tp.ProfilerActivity.CPU], schedule=schedule, on_trace_ready=handler) as prof:
            for _ in range(3):
                torch.randn(32, 32) @ torch.randn(32, 32)
                prof.step()
    return sorted(out.iterdir())


def test_torch_gzip_traces_are_analysed_and_a_cut_short_one_is_named(tmp_path):
    files = _torch_gzip_traces(tmp_path / "t")
    assert [p.name.split(".")[0] for p in files] == ["rank0", "rank1"]
    assert all(p.name.endswith(".pt.trace.json.gz") for p in files)  # torch's own name
    profile = load_profile(tmp_path / "t")
    assert profile.fmt == "torch_trace" and [r.rank for r in profile.ranks] == [0, 1]
    assert all(len(r.steps) == 2 for r in profile.ranks)  # the two active steps, read through gzip
    assert [r.rank for r in load_profile(files[1]).ranks] == [1]  # one file given directly
    assert stage.analyze(tmp_path / "t")["world"] == 2  # `profile analyze PATH`

    data = files[1].read_bytes()  # a rank's export killed half way: named in one line, never left out
    files[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(StageError, match=r"rank1\..*\.pt\.trace\.json\.gz") as e:
        load_profile(tmp_path / "t")
    assert "\n" not in str(e.value) and "collect the profile again" in str(e.value)
    files[1].write_bytes(b"not gzip")  # named as a gzip'd trace, not gzip at all: said so
    with pytest.raises(StageError, match=r"rank1\..*\.pt\.trace\.json\.gz is not gzip \(8 bytes, no gzip header\)"):
        load_profile(tmp_path / "t")


def test_a_gzip_trace_cut_short_after_its_header_is_named(tmp_path):
    """Every byte of the trace decompresses (it looks like one), the end of the gzip stream is missing."""
    raw = (FIX / "rank0.pt.trace.json").read_bytes()
    whole = gzip.compress(raw)
    path = tmp_path / "rank0.pt.trace.json.gz"
    path.write_bytes(whole[:-8])  # the stream without its end (CRC, size)
    with pytest.raises(StageError, match="not a complete gzip file.*collect the profile again") as e:
        load_profile(path)
    assert "\n" not in str(e.value)


# -- reuse: analysis-only settings re-analyse, collect settings collect again ------------------------------------------

ANALYSIS_CHANGES = [
    {"profile.analyzer": "builtin"},
    {"profile.regression_threshold": 0.5},
    {"profile.fail_on_regression": True},
]
COLLECT_CHANGES = [
    {"profile.skip_first": 2},
    {"profile.wait": 1},
    {"profile.warmup": 2},
    {"profile.active": 3},
    {"profile.record_shapes": True},
    {"profile.profile_memory": False},
    {"profile.with_stack": True},
    {"profile.npu_level": "Level0"},
    {"profile.aic_metrics": "Memory"},
    {"profile.use_msprof": True},
    {"train.lr": 1e-2},
]


@pytest.mark.parametrize("change", ANALYSIS_CHANGES + COLLECT_CHANGES, ids=lambda c: next(iter(c)))
def test_collect_digest_leaves_out_only_analysis_settings(cfg, change):
    before = stage.collect_digest(cfg)
    apply_overrides(cfg, change)
    assert (stage.collect_digest(cfg) == before) == (change in ANALYSIS_CHANGES)


def _shard_ctx(cfg, tmp_path: Path) -> StageContext:
    from data_prep.build import build_shard_set
    from tests.helpers.shards import shard_cfg

    shards = build_shard_set(shard_cfg(tmp_path / "shards")).shard_dir
    return StageContext(tmp_path / "run", "profile", Namespace(action="collect", path=None, shard_dir=str(shards)))


def _fake_launch(out: Path, routing: dict[int, dict]):
    """torchrun.run as a profiled run that exits 0: every rank's trace and rank 0's metrics.jsonl (router statistics
    per step, as the trainer's step_metrics writes them). Counts its launches."""
    launches = []

    def run(*_a, **_k):
        launches.append(1)
        run.argv = _a[0]
        traces = out / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        for r in (0, 1):
            shutil.copy(FIX / f"rank{r}.pt.trace.json", trace_path(traces, r))
        lines = [json.dumps({"step": s, "loss": 1.0, "moe_tokens_per_expert": t}) for s, t in sorted(routing.items())]
        (out / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return 0, ""

    return run, launches


def test_an_analysis_only_change_reuses_the_collect_a_collect_change_collects_again(cfg, tmp_path, monkeypatch):
    from tasks.launch import torchrun

    ctx = _shard_ctx(cfg, tmp_path)
    out = ctx.run_dir / "profile"
    fake, launches = _fake_launch(out, {})
    monkeypatch.setattr(torchrun, "run", fake)
    source, _ = stage.collect(cfg, ctx, out)
    assert launches == [1] and source == out / "traces"
    # torch elastic's per-rank files in the stage's logs (without --log-dir: a torchelastic_* directory in $TMPDIR)
    assert fake.argv[fake.argv.index("--log-dir") + 1] == str(out / "logs" / "torchelastic")
    marker = json.loads((out / "traces" / "collected.json").read_text())
    assert marker["collect_hash"] == stage.collect_digest(cfg) and marker["config_hash"] == cfg.digest()
    for change in ANALYSIS_CHANGES:
        apply_overrides(cfg, change)
        source, notes = stage.collect(cfg, ctx, out)
        assert launches == [1], change  # re-analysed, not collected again
        assert source == out / "traces" and notes[0].startswith("reused")
    apply_overrides(cfg, {"profile.active": 3})  # what the profiler records changed: collected again
    stage.collect(cfg, ctx, out)
    assert launches == [1, 1]


def test_moe_expert_load_counts_only_the_active_steps(cfg, tmp_path, monkeypatch):
    """Skipped and warm-up steps route everything to expert 0 (an untrained router); the recorded steps are even.
    The figure (and the rule) must see the recorded steps only, as the trace's figures do."""
    from tasks.launch import torchrun

    cfg.tracking.enabled = False
    pcfg = cfg.profile
    active = active_steps(pcfg)
    assert list(active) == list(range(pcfg.steps_needed() - pcfg.active + 1, pcfg.steps_needed() + 1))
    assert active.start > 1  # the demo config has steps before the recorded ones
    skewed, even = {"0": [40, 0, 0, 0]}, {"0": [10, 10, 10, 10]}
    routing = {s: even if s in active else skewed for s in range(1, pcfg.steps_needed() + 1)}
    ctx = _shard_ctx(cfg, tmp_path)
    fake, launches = _fake_launch(ctx.run_dir / "profile", routing)
    monkeypatch.setattr(torchrun, "run", fake)
    result = stage.run(cfg, ctx)
    assert launches == [1]
    report = json.loads(Path(result["report"]).read_text())
    assert report["moe"]["steps"] == pcfg.active
    assert report["moe"]["max_over_mean"] == pytest.approx(1.0)
    assert result["moe_load_max_over_mean"] == pytest.approx(1.0)
    assert not any(f["rule"] == "moe.expert_imbalance" for f in report["findings"])
