"""bench/run_all.py's merge: a partial run refreshes only its benches' figures; every other figure keeps the date
and machine it was measured on."""

import importlib.util
from pathlib import Path

RUN_ALL = Path(__file__).resolve().parent.parent / "bench" / "run_all.py"
spec = importlib.util.spec_from_file_location("run_all", RUN_ALL)
run_all = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)

OLD_MACHINE = {"platform": "Linux-old", "processor": "OldCPU", "cpus": 2}
NEW = {"date": "2026-12-01", "machine": {"platform": "Linux-new", "processor": "NewCPU", "cpus": 4}}


def test_legacy_file_partial_run_keeps_old_provenance_and_drops_stale_figures():
    legacy = {
        "figures": {"quant.latency_ratio_vs_fp32": 0.39, "quant.ppl_drop_pct": -0.01, "env.copy_gbps": 59.7},
        "date": "2026-11-29",
        "machine": OLD_MACHINE,
    }
    figures, prov = run_all.merge(legacy, {"quant": {"quant.decode_ratio_vs_bf16.b1": 1.1}}, NEW)
    # the quant bench was rerun: its renamed/dropped old figures go, its new one carries today's stamp
    assert "quant.latency_ratio_vs_fp32" not in figures and "quant.ppl_drop_pct" not in figures
    assert figures["quant.decode_ratio_vs_bf16.b1"] == 1.1
    assert prov["quant.decode_ratio_vs_bf16.b1"] == dict(NEW, bench="quant")
    # a bench not rerun keeps its value, its old date and its old machine
    assert figures["env.copy_gbps"] == 59.7
    assert prov["env.copy_gbps"]["date"] == "2026-11-29" and prov["env.copy_gbps"]["machine"] == OLD_MACHINE


def test_rerun_replaces_only_that_benchs_figures_and_markdown_names_refreshed():
    prev = {
        "figures": {"sharding.tokens_per_s": 1, "loader.samples_per_s": 2, "train_step.x": 3},
        "provenance": {
            "sharding.tokens_per_s": {"date": "d0", "machine": OLD_MACHINE, "bench": "data"},
            "loader.samples_per_s": {"date": "d0", "machine": OLD_MACHINE, "bench": "data"},
            "train_step.x": {"date": "d0", "machine": OLD_MACHINE, "bench": "train_step"},
        },
    }
    figures, prov = run_all.merge(prev, {"data": {"sharding.tokens_per_s": 5}}, NEW)
    assert figures == {"sharding.tokens_per_s": 5, "train_step.x": 3}  # loader.* came from data: not reported now
    assert prov["train_step.x"]["date"] == "d0"
    md = run_all.markdown(
        {"figures": figures, "provenance": prov, "refreshed": ["data"], "errors": {}, "date": NEW["date"]}
    )
    assert "refreshed: data." in md
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| `")}
    assert "d0 M" in rows["`train_step.x`"] and "2026-12-01 M" in rows["`sharding.tokens_per_s`"]
    assert "OldCPU" in md and "NewCPU" in md


def test_tree_memory_counts_worker_processes():
    """bench_data's peak memory includes child processes (the tokenizer/writer workers), not only the parent."""
    import subprocess
    import sys
    import time

    spec = importlib.util.spec_from_file_location(
        "bench_data", Path(__file__).resolve().parent.parent / "bench" / "bench_data.py"
    )
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
