"""bench/run_all.py: partial runs refresh only their benches' figures, every figure carries its bench, date, machine,
commit and host load, a loaded run does not replace quieter figures unless forced, the committed results.json,
results.md and docs/benchmarks.md block are exactly what the runner writes, and the deterministic figures
(bench_planner) are what the code computes today."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)

OLD_MACHINE = {"platform": "Linux-old", "processor": "OldCPU", "cpus": 2}
NEW = {"date": "2026-12-01", "machine": {"platform": "Linux-new", "processor": "NewCPU", "cpus": 4}, "commit": "c1"}
QUIET = {"load1_mean": 1.5, "cpus": 2, "loaded": False, "steal_pct": 0.0}
BUSY = {"load1_mean": 19.0, "cpus": 2, "loaded": True, "steal_pct": 1.0}


def test_legacy_file_partial_run_keeps_old_provenance_and_drops_stale_figures():
    legacy = {
        "figures": {"quant.latency_ratio_vs_fp32": 0.39, "quant.ppl_drop_pct": -0.01, "env.copy_gbps": 59.7},
        "date": "2026-11-29",
        "machine": OLD_MACHINE,
    }
    stamp = dict(NEW, load=QUIET)
    figures, prov = run_all.merge(legacy, {"quant": {"quant.decode_ratio_vs_bf16.b1": 1.1}}, {"quant": stamp})
    # the quant bench was rerun: its renamed/dropped old figures go, its new one carries today's stamp
    assert "quant.latency_ratio_vs_fp32" not in figures and "quant.ppl_drop_pct" not in figures
    assert figures["quant.decode_ratio_vs_bf16.b1"] == 1.1
    assert prov["quant.decode_ratio_vs_bf16.b1"] == dict(stamp, bench="quant")
    # a bench not rerun keeps its value, its old date and machine; commit and load say they were not recorded
    assert figures["env.copy_gbps"] == 59.7
    old = prov["env.copy_gbps"]
    assert (old["date"], old["machine"], old["commit"], old["load"]) == ("2026-11-29", OLD_MACHINE, "unknown", None)


def test_rerun_replaces_only_that_benchs_figures_and_markdown_names_refreshed_and_load():
    prev = {
        "figures": {"sharding.tokens_per_s": 1, "loader.samples_per_s": 2, "train_step.x": 3},
        "provenance": {
            "sharding.tokens_per_s": {"date": "d0", "machine": OLD_MACHINE, "bench": "data"},
            "loader.samples_per_s": {"date": "d0", "machine": OLD_MACHINE, "bench": "data"},
            "train_step.x": {"date": "d0", "machine": OLD_MACHINE, "bench": "train_step", "load": BUSY},
        },
    }
    figures, prov = run_all.merge(prev, {"data": {"sharding.tokens_per_s": 5}}, {"data": dict(NEW, load=QUIET)})
    assert figures == {"sharding.tokens_per_s": 5, "train_step.x": 3}  # loader.* came from data: not reported now
    assert prov["train_step.x"]["date"] == "d0"
    md = run_all.markdown(
        {"figures": figures, "provenance": prov, "refreshed": ["data"], "errors": {}, "date": NEW["date"]}
    )
    assert "refreshed: data." in md
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| `")}
    assert "d0 M" in rows["`train_step.x`"] and "load 19.0/2 CPUs, steal 1.0% ⚠ loaded" in rows["`train_step.x`"]
    assert "2026-12-01 M" in rows["`sharding.tokens_per_s`"] and "commit c1, load 1.5/2 CPUs" in md
    assert "OldCPU" in md and "NewCPU" in md


def test_host_load_mean_max_and_steal_from_proc(monkeypatch):
    """Steal is the 8th column of /proc/stat's cpu line over the sum of the first eight, between start and end."""
    loads = iter([3.0, 5.0, 7.0, 9.0])
    stats = iter([[100, 0, 50, 800, 0, 0, 0, 50, 0, 0], [200, 0, 100, 1500, 0, 0, 0, 200, 9, 9]])
    monkeypatch.setattr(run_all, "_load1", lambda: next(loads))
    monkeypatch.setattr(run_all, "_cpu_times", lambda: next(stats))
    monkeypatch.setattr(run_all.os, "cpu_count", lambda: 4)
    with run_all.HostLoad(every=3600) as load:  # the sampler thread adds nothing: start and end samples only
        pass
    r = load.result()
    assert (r["load1_start"], r["load1_mean"], r["load1_max"], r["cpus"]) == (3.0, 4.0, 5.0, 4)
    assert r["steal_pct"] == 15.0 and r["loaded"] is False  # 150 of 1000 ticks; mean 4.0 is not above 4 CPUs
    stats = iter([[0] * 8, [0] * 8])
    with run_all.HostLoad(every=3600) as load:
        pass
    assert load.result()["loaded"] is True and load.result()["steal_pct"] == 0.0  # mean 8.0 > 4


def _fake_repo(tmp_path, monkeypatch, value: int, load: dict):
    """run_all pointed at a scratch bench/ with one bench `x` whose run() returns {"x.v": value}."""
    bench = tmp_path / "bench"
    bench.mkdir(exist_ok=True)
    (bench / "bench_x.py").write_text(f"def run():\n    return {{'x.v': {value}}}\n")
    # rewritten within a second at the same size: a cached .pyc (source mtime and size match) would run the old value
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    shutil.rmtree(bench / "__pycache__", ignore_errors=True)
    docs = tmp_path / "benchmarks.md"
    if not docs.exists():
        docs.write_text(f"# B\n\nprose\n\n{run_all.BEGIN}\n{run_all.END}\n\nmore prose\n")
    for name, path in (("HERE", bench), ("RESULTS", bench / "results.json"), ("RESULTS_MD", bench / "results.md")):
        monkeypatch.setattr(run_all, name, path)
    monkeypatch.setattr(run_all, "DOCS", docs)
    monkeypatch.setattr(run_all, "DOC_FIGURES", {"X": ["x.v", "x.missing"]})
    monkeypatch.setattr(run_all.HostLoad, "result", lambda self: dict(load))
    return bench / "results.json", docs


def test_loaded_run_keeps_quieter_figures_unless_forced(tmp_path, monkeypatch, capsys):
    results, docs = _fake_repo(tmp_path, monkeypatch, 1, QUIET)
    assert run_all.main(["x"]) == 0
    first = json.loads(results.read_text())
    assert first["provenance"]["x.v"]["load"] == QUIET and first["provenance"]["x.v"]["commit"]
    _fake_repo(tmp_path, monkeypatch, 2, BUSY)
    assert run_all.main(["x"]) == 3  # loaded: the quieter figure stays, and the run says so
    assert "kept the figures of" in capsys.readouterr().err
    kept = json.loads(results.read_text())
    assert kept["figures"]["x.v"] == 1 and kept["provenance"]["x.v"]["load"] == QUIET and "x" in kept["kept"]
    assert run_all.main(["x", "--force"]) == 0
    forced = json.loads(results.read_text())
    assert forced["figures"]["x.v"] == 2 and forced["provenance"]["x.v"]["load"]["loaded"] is True
    _fake_repo(tmp_path, monkeypatch, 3, dict(BUSY, load1_mean=25.0))
    assert run_all.main(["x"]) == 3  # busier than the (forced) busy figures: kept too
    _fake_repo(tmp_path, monkeypatch, 4, dict(BUSY, load1_mean=10.0))
    assert run_all.main(["x"]) == 0  # loaded but quieter than what is recorded: replaces it
    text = docs.read_text()
    assert text.startswith("# B\n\nprose\n\n") and text.endswith("\n\nmore prose\n")  # only the block changes
    assert "| `x.v` | 4 |" in text and "| `x.missing` | — | not in results.json |" in text


def test_unknown_option_and_bench_are_refused(capsys):
    assert run_all.main(["--fast"]) == 2 and run_all.main(["no_such_bench"]) == 2
    assert "unknown option --fast" in capsys.readouterr().err


def test_committed_results_are_the_runners_output():
    """results.json in the one format run_all writes, every figure with full provenance, and results.md and the
    docs/benchmarks.md block exactly what run_all renders from it: a figure typed into one of them fails here."""
    text = (ROOT / "bench" / "results.json").read_text()
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n"
    assert set(doc["figures"]) == set(doc["provenance"])
    for key, p in doc["provenance"].items():
        assert {"bench", "date", "machine", "commit", "load"} <= set(p), key
    assert (ROOT / "bench" / "results.md").read_text() == run_all.markdown(doc)
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert run_all.rewrite_docs(docs, run_all.docs_block(doc)) == docs


def _deterministic_benches() -> list[str]:
    names = []
    for path in sorted((ROOT / "bench").glob("bench_*.py")):
        if "\nDETERMINISTIC = True" in path.read_text():
            names.append(path.stem[len("bench_") :])
    return names


@pytest.mark.parametrize("name", _deterministic_benches())
def test_deterministic_figures_match_the_code(name):
    """Recompute a deterministic bench (bench_planner: the planner's verdicts and activation estimates) and compare
    with results.json: a planner change without `python bench/run_all.py planner` fails here."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"bench_{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.DETERMINISTIC is True
    doc = json.loads((ROOT / "bench" / "results.json").read_text())
    committed = {k: v for k, v in doc["figures"].items() if doc["provenance"][k]["bench"] == name}
    assert mod.run() == committed


def test_tree_memory_counts_worker_processes():
    """bench_data's peak memory includes child processes (the tokenizer/writer workers), not only the parent."""
    import subprocess
    import sys
    import time

    spec = importlib.util.spec_from_file_location("bench_data", ROOT / "bench" / "bench_data.py")
    bench_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_data)
    with bench_data.TreeMemory() as alone:
        time.sleep(0.1)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; x = bytearray(80_000_000); "
            "x[::4096] = b'1' * len(x[::4096]); print(flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()  # the child has touched its 80 MB
        with bench_data.TreeMemory() as tree:
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()
    assert tree.rss_kb - alone.rss_kb > 70_000 and tree.pss_kb - alone.pss_kb > 70_000
