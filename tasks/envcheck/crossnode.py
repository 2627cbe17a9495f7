"""Cross-node probe (hardware.nnodes > 1): the env stage's collective probe over every node, through the same c10d
rendezvous training uses (hardware.rdzv_endpoint), before a training job finds a bad link as a collective timeout.

Every node's env stage starts one torchrun agent (`--nnodes N --rdzv-backend c10d`) running crossnode_worker; they
meet at node 0's endpoint within `timeouts.rendezvous_s`. Reported per node and link: reachable, bandwidth of the
link to rank 0's node, clock offset against node 0, slow ranks and slow links, by host name. A node that never
arrives ends the probe at the rendezvous bound with one line naming it: each node drops an arrival marker (its host
name) in the run directory first, so the nodes that did arrive say which one did not.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

from tasks.bounds import run_bounded
from tasks.config import REPO_ROOT
from tasks.envcheck import check
from tasks.envcheck.probe import fresh_elastic_log_dir, worker_args
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, read_json

SLOW_FACTOR = 2.0  # a rank whose matmul takes this much longer than the median, a link this much slower: "slow"
PROBE_TIMEOUT_S = 120  # collectives once every node has arrived


def marker(run_dir: Path, node: int) -> Path:
    return Path(run_dir) / "env" / "nodes" / f"node{node}.json"


def command(
    kind: str,
    nproc: int,
    nnodes: int,
    endpoint: str,
    rdzv_id: str,
    join_timeout_s: int,
    sizes_mb: list[float],
    out: Path,
    timeout_s: int = PROBE_TIMEOUT_S,
    launcher: list[str] | None = None,
) -> list[str]:
    """`launcher`: what starts torchrun (the env stage passes tasks.launch.torchrun.launcher(kind)); default
    torch.distributed.run."""
    return [
        sys.executable,
        *(launcher or ["-m", "torch.distributed.run"]),
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=join_timeout={join_timeout_s}",
        "--max-restarts=0",
        *worker_args("tasks.envcheck.crossnode_worker", kind, sizes_mb, timeout_s, out),
    ]


def arrived(run_dir: Path, nnodes: int, since: float) -> dict[int, str]:
    """node → host name of the nodes whose env stage reached the probe in this attempt."""
    out = {}
    for node in range(nnodes):
        path = marker(run_dir, node)
        if path.is_file():
            m = read_json(path)
            if m.get("time", 0) >= since:
                out[node] = m.get("host", "?")
    return out


def _not_arrived(run_dir: Path, hw, endpoint: str, join_timeout_s: int, started: float) -> str:
    here = arrived(run_dir, hw.nnodes, started - join_timeout_s - 60)
    missing = [n for n in range(hw.nnodes) if n not in here]
    came = ", ".join(f"node {n} on {h}" for n, h in sorted(here.items())) or "none"
    if missing:
        names = ", ".join(f"node {n}" for n in missing)
        verb = "never arrives" if len(missing) == 1 else "never arrive"
        return (
            f"cross-node probe: {names} {verb} at the c10d rendezvous {endpoint} within {join_timeout_s} s "
            f"(arrived: {came}); start the env stage on {names} (hardware.node_rank) and check that it reaches "
            f"{endpoint} (address, firewall)"
        )
    return (
        f"cross-node probe: every node started ({came}) but the c10d rendezvous at {endpoint} did not complete "
        f"within {join_timeout_s} s; check that each node reaches {endpoint} (it must be node 0's address)"
    )


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def run(
    kind: str,
    nproc: int,
    hw,
    sizes_mb: list[float],
    run_dir: Path,
    rdzv_id: str,
    join_timeout_s: int,
    env_extra: dict | None = None,
    probe_timeout_s: int = PROBE_TIMEOUT_S,
    launcher: list[str] | None = None,
) -> dict:
    """This node's part of the probe; returns the result (every node gets it) or {"error": one line}."""
    run_dir = Path(run_dir)
    started = time.time()
    atomic_write_json(
        marker(run_dir, hw.node_rank),
        {"node": hw.node_rank, "host": socket.gethostname(), "time": started, "rdzv_id": rdzv_id},
    )
    out = run_dir / "env" / f"crossnode-node{hw.node_rank}.json"
    out.unlink(missing_ok=True)
    fresh_elastic_log_dir(out)
    env = {**os.environ, **(env_extra or {}), "LLM_NODE_RANK": str(hw.node_rank)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    argv = command(
        kind, nproc, hw.nnodes, hw.rdzv_endpoint, rdzv_id, join_timeout_s, sizes_mb, out, probe_timeout_s, launcher
    )
    log = run_dir / "env" / f"crossnode-node{hw.node_rank}.log"
    bound = join_timeout_s + probe_timeout_s + 60
    try:
        rc = run_bounded(
            argv,
            env=env,
            cwd=REPO_ROOT,
            log_path=log,
            timeout_s=bound,
            what="cross-node probe",
            how="timeouts.rendezvous_s + the probe's own collective timeout",
        )
    except StageError as e:
        return {"error": str(e)}
    text = log.read_text(encoding="utf-8", errors="replace")
    if rc != 0 or not out.is_file():
        if re.search(r"RendezvousTimeoutError|rendezvous.*(timed out|timeout)", text, re.I):
            return {
                "error": _not_arrived(run_dir, hw, hw.rdzv_endpoint, join_timeout_s, started),
                "missing": [
                    n for n in range(hw.nnodes) if n not in arrived(run_dir, hw.nnodes, started - join_timeout_s - 60)
                ],
            }
        return {"error": f"cross-node probe failed (torchrun exit {rc}): {_last_error(text)} (log: {log})"}
    return read_json(out)


def judge(result: dict, hw) -> list[dict]:
    """Checks from a cross-node result: nodes (reachable, slow ranks/links by host) and clock offsets."""
    if "error" in result:
        return [check("nodes", "fail", result["error"])]
    nodes = result["nodes"]
    out = []
    missing = sorted(set(range(hw.nnodes)) - {n["node"] for n in nodes})
    if missing:
        out.append(check("nodes", "fail", f"node(s) {missing} missing from the probe's process group"))
    ranks = result.get("ranks", [])
    slow = []
    times = [r["matmul_ms"] for r in ranks]
    if len(times) > 1:
        med = statistics.median(times)
        slow += [
            f"rank {r['rank']} on node {r['node']} ({r['host']}): matmul {r['matmul_ms']:.1f} ms vs median {med:.1f} ms"
            for r in ranks
            if r["matmul_ms"] > SLOW_FACTOR * med
        ]
    links = [n for n in nodes if n.get("link_gbps")]
    if len(links) > 1:
        med = statistics.median(n["link_gbps"] for n in links)
        slow += [
            f"link to node {n['node']} ({n['host']}): {n['link_gbps']:.2f} GB/s vs median {med:.2f} GB/s"
            for n in links
            if n["link_gbps"] * SLOW_FACTOR < med
        ]
    per_node = "; ".join(
        f"node {n['node']} {n['host']} ranks {min(n['ranks'])}-{max(n['ranks'])}"
        + (f" link {n['link_gbps']:.2f} GB/s rtt {n['rtt_ms']:.2f} ms" if n.get("link_gbps") else "")
        for n in nodes
    )
    out.append(
        check("nodes", "warn", "slow: " + "; ".join(slow))
        if slow
        else check("nodes", "ok", f"{len(nodes)} nodes reachable: {per_node}")
    )
    worst = max(nodes, key=lambda n: abs(n.get("clock_offset_ms") or 0.0))
    offset = worst.get("clock_offset_ms") or 0.0
    figure = f"largest clock offset vs node 0: {offset:+.1f} ms on node {worst['node']} ({worst['host']})"
    out.append(
        check(
            "clock-nodes",
            "fail",
            f"{figure} exceeds hardware.max_clock_offset_ms {hw.max_clock_offset_ms:g}: sync NTP/chrony on every node",
        )
        if abs(offset) > hw.max_clock_offset_ms
        else check("clock-nodes", "ok", figure)
    )
    return out
