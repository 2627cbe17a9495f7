"""The cross-node probe on one machine: two "nodes" = two torchrun agents meeting at a c10d rendezvous on
127.0.0.1, through the env stage itself; and a node that never arrives, named in one line within the bound."""

import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.envcheck import crossnode
from tests.helpers.ports import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_nodes_probe_every_link_through_the_env_stage(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    (tmp_path / "tmp").mkdir()  # the nodes' temporary directory: their probes' torchrun must leave nothing there
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    procs = []
    for node in (0, 1):
        argv = [
            sys.executable,
            "-m",
            "tasks",
            "env",
            "--config",
            "ci-tiny",
            "--no-tracking",
            "--run-dir",
            str(run_dir),
            "--json",
            "--set",
            "hardware.nnodes=2",
            "--set",
            f"hardware.node_rank={node}",
            "--set",
            f"hardware.rdzv_endpoint=127.0.0.1:{port}",
            "--set",
            "hardware.nproc_per_node=1",
            "--set",
            "timeouts.rendezvous_s=120",
        ]
        procs.append(
            subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    report = json.loads((run_dir / "env" / "env.json").read_text())
    probe = report["probe"]
    assert probe["world_size"] == 2 and probe["allreduce_ok"] and probe["ranks_forked"]  # as training's CPU ranks
    nodes = {n["node"]: n for n in probe["nodes"]}
    assert set(nodes) == {0, 1} and all(n["host"] == socket.gethostname() and n["reachable"] for n in nodes.values())
    assert nodes[0]["clock_offset_ms"] == 0.0 and abs(nodes[1]["clock_offset_ms"]) < 100  # one clock here
    linked = [n for n in nodes.values() if n.get("link_gbps")]
    assert len(linked) == 1 and linked[0]["link_gbps"] > 0 and linked[0]["rtt_ms"] > 0
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["nodes"]["status"] == "ok" and "2 nodes reachable" in checks["nodes"]["detail"]
    assert checks["clock-nodes"]["status"] == "ok" and checks["allreduce"]["status"] == "ok"
    node1 = json.loads((run_dir / "env-node1.json").read_text())  # node 1's own stage result
    assert node1["status"] in ("ok", "warn")
    assert json.loads((run_dir / "env" / "crossnode-node1.json").read_text())["nodes"] == probe["nodes"]
    # each node's torch elastic files beside its probe result, not torchelastic_* directories left in $TMPDIR
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))
    assert all((run_dir / "env" / f"crossnode-node{n}-torchelastic").is_dir() for n in (0, 1))


def test_a_node_that_never_arrives_is_named_within_the_bound(cfg, tmp_path):
    hw = copy.deepcopy(cfg.hardware)
    hw.nnodes, hw.node_rank, hw.rdzv_endpoint = 2, 0, f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = crossnode.run("cpu", 1, hw, [1], tmp_path, rdzv_id="missing", join_timeout_s=5)
    took = time.monotonic() - started
    assert took < 5 + 60, took  # the rendezvous bound plus torchrun's start-up, not torchrun's 600 s default
    cause = result["error"]
    assert result["missing"] == [1] and "\n" not in cause
    assert cause.startswith(
        "cross-node probe: node 1 never arrives at the c10d rendezvous "
        f"{hw.rdzv_endpoint} within 5 s (arrived: node 0 on {socket.gethostname()})"
    )
    checks = crossnode.judge(result, hw)
    assert [(c["name"], c["status"]) for c in checks] == [("nodes", "fail")]


def test_judge_names_slow_ranks_links_and_clock_skew_by_host(cfg):
    hw = copy.deepcopy(cfg.hardware)
    hw.nnodes, hw.max_clock_offset_ms = 3, 50.0

    def node(n, host, gbps, off):
        return {
            "node": n,
            "host": host,
            "ranks": [n],
            "reachable": True,
            "rtt_ms": 0.1,
            "link_gbps": gbps,
            "clock_offset_ms": off,
        }

    result = {
        "world_size": 3,
        "allreduce_ok": True,
        "sizes": [],
        "ranks": [
            {"rank": i, "node": i, "host": h, "local_rank": 0, "matmul_ms": t}
            for i, (h, t) in enumerate([("a", 1.0), ("b", 1.1), ("c", 9.0)])
        ],
        "nodes": [node(0, "a", None, 0.0), node(1, "b", 10.0, 3.0), node(2, "c", 1.0, -80.0)],
    }
    nodes, clock = crossnode.judge(result, hw)
    assert nodes["status"] == "warn" and "rank 2 on node 2 (c)" in nodes["detail"]
    assert "link to node 2 (c): 1.00 GB/s" in nodes["detail"] and "node 1" not in nodes["detail"]
    assert clock["status"] == "fail" and "-80.0 ms on node 2 (c)" in clock["detail"]
