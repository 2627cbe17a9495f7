"""The profile stage with inputs it was not written around: a trace folder where one rank's trace is empty or cut
short (it was silently left out: a 2-rank run reported as 1 rank, no slow-rank finding), a reused collect whose
trace was deleted since, `profile.use_msprof` on a CPU run (its note blamed a missing msprof and named
torch_npu.profiler), `profile.analyzer=msprof-analyze` on CPU refused only after the whole profiled run, and real
msprof-analyze output (tests/fixtures/profiling_upstream, copied from Ascend/msprof-analyze) with a column lost: the
error said the step trace was "missing" or had "no rank rows" when the file was there without one column."""

from __future__ import annotations

import csv
import io
import shutil
from argparse import Namespace
from pathlib import Path

import pytest

from tasks import runner
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json
from tasks.profiling.collect import trace_path
from tasks.profiling.loader import load_profile
from tasks.runner import StageContext
from tasks.stages.profile import collect, missing_ranks, msprof_note, planned_launch

FIX = Path(__file__).resolve().parent / "fixtures" / "profiling"
UPSTREAM = Path(__file__).resolve().parent / "fixtures" / "profiling_upstream"
TRACE = FIX / "torch_cuda_healthy" / "rank0.pt.trace.json"


class Launched(Exception):
    """torchrun.run was reached: the stage went on to launch a profiled run."""


def _no_launch(*_a, **_k):
    raise Launched


@pytest.mark.parametrize("content", [b"", b"{\n  "], ids=["empty", "cut-before-its-keys"])
def test_a_rank_trace_that_is_empty_or_cut_short_fails_in_one_line(tmp_path, content):
    shutil.copytree(FIX / "torch_cuda_healthy", tmp_path / "t")
    assert len(load_profile(tmp_path / "t").ranks) == 2
    (tmp_path / "t" / "rank1.pt.trace.json").write_bytes(content)
    for path in (tmp_path / "t", tmp_path / "t" / "rank1.pt.trace.json"):  # the folder, or the file itself
        with pytest.raises(StageError, match=r"rank1\.pt\.trace\.json (is empty|is not a torch.profiler trace)") as e:
            load_profile(path)
        assert "\n" not in str(e.value) and "collect the profile again" in str(e.value)


def test_other_json_beside_the_traces_is_still_ignored(tmp_path):
    """collect's own collected.json lives in the traces folder: only files named as traces must be traces."""
    shutil.copytree(FIX / "torch_cuda_healthy", tmp_path / "t")
    (tmp_path / "t" / "collected.json").write_text("{}")
    (tmp_path / "t" / ".rank1.pt.trace.json.tmp").write_bytes(b"")  # a killed export's temporary file
    assert len(load_profile(tmp_path / "t").ranks) == 2


def test_missing_ranks_by_backend(tmp_path):
    for r in (0, 2):
        shutil.copy(TRACE, trace_path(tmp_path, r))
    trace_path(tmp_path, 3).write_bytes(b"")
    assert missing_ranks(tmp_path, "cpu", 4) == [1, 3]
    assert missing_ranks(tmp_path, "cuda", 3) == [1]
    (tmp_path / "rank0_20260101120000123_ascend_pt").mkdir()
    (tmp_path / "rank10_20260101120000123_ascend_pt").mkdir()  # rank 10's folder is not rank 1's
    assert missing_ranks(tmp_path, "npu", 2) == [1]


def _collected(cfg, tmp_path):
    from data_prep.build import build_shard_set
    from tests.helpers.shards import shard_cfg

    shards = build_shard_set(shard_cfg(tmp_path / "shards")).shard_dir
    ctx = StageContext(tmp_path / "run", "profile", Namespace(shard_dir=str(shards)), {})
    shard = str(runner.shard_set(cfg, ctx))  # as collect: the config follows the shard set before the digest
    launch = planned_launch(cfg, ctx)
    out = tmp_path / "run" / "profile"
    traces = out / "traces"
    traces.mkdir(parents=True)
    for r in range(launch["world"]):
        shutil.copy(TRACE, trace_path(traces, r))
    marker = {"config_hash": cfg.digest(), "shard_dir": shard, "backend": "cpu", "source": str(traces), **launch}
    atomic_write_json(traces / "collected.json", marker)
    return ctx, out, traces, launch["world"]


def test_a_reused_collect_missing_a_rank_trace_is_collected_again(cfg, tmp_path, monkeypatch):
    """A trace deleted after the collect: reusing the rest reported a dp2 run as 1 rank, status ok."""
    from tasks.launch import torchrun

    monkeypatch.setattr(torchrun, "run", _no_launch)
    ctx, out, traces, world = _collected(cfg, tmp_path)
    assert world == 2
    source, notes = collect(cfg, ctx, out)
    assert source == traces and notes[0].startswith("reused")
    trace_path(traces, 1).unlink()
    with pytest.raises(Launched):
        collect(cfg, ctx, out)


def test_msprof_analyze_on_a_cpu_run_is_refused_before_the_run(cfg, tmp_path, monkeypatch):
    from tasks.launch import torchrun

    monkeypatch.setattr(torchrun, "run", _no_launch)
    cfg.profile.analyzer = "msprof-analyze"
    ctx, out, traces, _ = _collected(cfg, tmp_path)
    shutil.rmtree(traces)  # nothing to reuse
    with pytest.raises(StageError, match="collects on cpu .*use profile.analyzer=auto or builtin"):
        collect(cfg, ctx, out)


def test_use_msprof_note_names_what_collected_on_each_backend(tmp_path):
    cpu = msprof_note("cpu", None, tmp_path)
    assert "NPU runs only" in cpu and "torch.profiler" in cpu and "torch_npu" not in cpu and "PATH" not in cpu
    assert "not on PATH" in msprof_note("npu", None, tmp_path)
    assert str(tmp_path) in msprof_note("npu", "/usr/bin/msprof", tmp_path)


def test_a_run_where_a_rank_wrote_no_trace_fails_and_leaves_no_marker(cfg, tmp_path, monkeypatch):
    """The launch exits 0 but rank 1 wrote nothing: one line naming the rank, and no collected.json a rerun would
    reuse (before: the stage reported rank 0 alone as the run)."""
    from tasks.launch import torchrun

    ctx, out, traces, _ = _collected(cfg, tmp_path)
    shutil.rmtree(traces)  # nothing to reuse

    def rank0_only(*_a, **_k):
        traces.mkdir()
        shutil.copy(TRACE, trace_path(traces, 0))
        return 0, ""

    monkeypatch.setattr(torchrun, "run", rank0_only)
    with pytest.raises(StageError, match=r"rank\(s\) 1 of 2 wrote no trace") as e:
        collect(cfg, ctx, out)
    assert "\n" not in str(e.value)
    assert not (traces / "collected.json").exists()


def _copy_without(src: Path, dst: Path, csv_name: str, column: str) -> Path:
    """src copied to dst with `column` removed from every `csv_name` in it (a real file, one column lost)."""
    shutil.copytree(src, dst)
    for f in dst.rglob(csv_name):
        rows = list(csv.reader(io.StringIO(f.read_text(encoding="utf-8-sig"), newline="")))
        i = rows[0].index(column)
        out = io.StringIO(newline="")
        csv.writer(out).writerows(r[:i] + r[i + 1 :] for r in rows)
        f.write_text(out.getvalue(), encoding="utf-8", newline="")
    return dst


def test_upstream_cluster_step_trace_without_a_column_is_named_not_missing(tmp_path):
    root = _copy_without(UPSTREAM / "msprof_analyze_cluster", tmp_path / "c", "cluster_step_trace_time.csv", "Free")
    with pytest.raises(
        StageError,
        match=r"cluster_step_trace_time\.csv header not recognised as cluster_step_trace "
        r"\(no column Free\)",
    ) as e:
        load_profile(root)
    assert "\n" not in str(e.value)


def test_upstream_kernel_details_without_a_column_is_named_not_missing(tmp_path):
    """A kernels-only folder (older CANN) whose kernel_details.csv lost Duration(us): was "step_trace_time.csv (or
    trace_view.json) missing"."""
    root = _copy_without(UPSTREAM / "msprof_analyze_kernels", tmp_path / "k", "kernel_details.csv", "Duration(us)")
    with pytest.raises(
        StageError,
        match=r"kernel_details\.csv header not recognised as kernel_details \(no column "
        r"Duration\(us\)\) — no step breakdown",
    ) as e:
        load_profile(root)
    assert "missing" not in str(e.value)


def test_an_unread_kernel_table_beside_a_step_trace_is_a_note(tmp_path):
    root = _copy_without(FIX / "ascend_pt_new_healthy", tmp_path / "a", "kernel_details.csv", "Accelerator Core")
    notes = load_profile(root).notes
    assert len(notes) == 2 and all(
        "(no column Accelerator Core): operators from op_statistic instead" in n for n in notes
    )
    assert load_profile(FIX / "ascend_pt_new_healthy").notes == []  # the intact folder: no note


def test_a_path_with_collect_and_a_shard_dir_with_analyze_are_refused(tmp_path, capsys):
    """`profile collect PATH` collected and never looked at PATH; `profile analyze PATH --shard-dir X` dropped X."""
    from tasks import cli

    traces = FIX / "torch_cuda_healthy"
    run = ["--run-dir", str(tmp_path / "run"), "--no-tracking"]
    assert cli.main(["profile", "collect", str(traces), *run]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"profile collect takes no PATH (got {traces})" in err
    assert cli.main(["profile", "analyze", str(traces), "--shard-dir", str(tmp_path), *run]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop --shard-dir" in err
    assert not (tmp_path / "run" / "profile" / "report.json").exists()


def test_docs_stages_names_every_rule_the_profile_stage_can_report():
    """Every finding's rule id the profiling code can emit (a `Finding("…")` or a `{"rule": "…"}` in
    tasks/profiling/) is in docs/stages.md's Profiling section, where a user reads what each means and its threshold."""
    import ast
    import re

    repo = Path(__file__).resolve().parent.parent
    rules = set()
    for path in (repo / "tasks" / "profiling").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding" and node.args:
                rules.add(node.args[0].value)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "rule" and isinstance(value, ast.Constant):
                        rules.add(value.value)
    assert {"utilisation.low", "moe.expert_imbalance", "analysis.disagreement", "operator.ai_cpu_list"} <= rules
    stages_md = (repo / "docs" / "stages.md").read_text()
    section = stages_md[stages_md.index("## Profiling") :].split("\n## ")[0]
    named = set(re.findall(r"`([a-z]+\.[a-z_]+)`", section))
    assert rules - named == set(), f"rules missing from docs/stages.md's Profiling section: {sorted(rules - named)}"
