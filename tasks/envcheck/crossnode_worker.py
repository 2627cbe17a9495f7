"""torchrun worker of the cross-node probe (tasks.envcheck.crossnode): every rank of every node, one process group.

Per node: host name, reachability and bandwidth of the link to node 0 (point-to-point between the node leaders),
clock offset against node 0 (NTP-style ping-pong over the same link, the sample with the shortest round trip).
Per rank: a short local matmul (a throttled or faulty chip shows up as a slow rank). Over all ranks: all_reduce
correctness and bus bandwidth. Rank 0 assembles the report; each node's local rank 0 writes it to its --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from tasks import collectives
from tasks import device as devlayer
from tasks.envcheck.probe_worker import _bandwidth, _correctness
from tasks.fsutil import atomic_write_json
from tasks.parallel.affinity import FORKED


def _matmul_ms(dev, n: int = 256, iters: int = 5) -> float:
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    a @ b  # warm-up
    devlayer.synchronize(dev)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    devlayer.synchronize(dev)
    return (time.perf_counter() - start) / iters * 1e3


def _clock_and_link(dev, rank: int, leaders: list[int], size_mb: float, samples: int = 5) -> dict:
    """Rank 0 against each other node's leader, one at a time: clock offset (ms) and link bandwidth (GB/s). The
    peer's clock travels as int64 nanoseconds (time.time_ns): exact, and no float64 on the wire (HCCL's reductions
    refuse fp64 and this project keeps it off every collective: tasks/collectives.py)."""
    out = {}
    stamp = torch.zeros(1, dtype=torch.int64, device=dev)
    numel = max(1, int(size_mb * 2**20) // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=dev)
    for peer in leaders:
        if peer == 0:
            continue
        if rank == 0:
            best = None
            for _ in range(samples):
                t0 = time.time_ns()
                collectives.send(stamp, peer)
                collectives.recv(stamp, peer)
                t1 = time.time_ns()
                sample = (t1 - t0, int(stamp.item()) - (t0 + t1) // 2)  # (round trip, offset) in ns
                best = sample if best is None or sample[0] < best[0] else best
            collectives.send(buf, peer)  # warm-up of the data path
            collectives.recv(buf, peer)
            devlayer.synchronize(dev)
            start = time.perf_counter()
            collectives.send(buf, peer)
            collectives.recv(buf, peer)
            devlayer.synchronize(dev)
            seconds = (time.perf_counter() - start) / 2
            out[peer] = {
                "rtt_ms": best[0] / 1e6,
                "clock_offset_ms": best[1] / 1e6,
                "link_gbps": numel * 4 / seconds / 1e9,
            }
        elif rank == peer:
            for _ in range(samples):
                collectives.recv(stamp, 0)
                stamp.fill_(time.time_ns())
                collectives.send(stamp, 0)
            for _ in range(2):
                collectives.recv(buf, 0)
                collectives.send(buf, 0)
        collectives.barrier()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True, choices=sorted(devlayer.DIST_BACKEND))
    p.add_argument("--sizes-mb", type=float, nargs="*", default=[])
    p.add_argument("--link-mb", type=float, default=16.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=int, default=120)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    dev = devlayer.torch_device(args.kind, local_rank)
    dist.init_process_group(devlayer.dist_backend(args.kind), timeout=datetime.timedelta(seconds=args.timeout_s))
    # The configured node rank (hardware.node_rank), not torchrun's arrival order: what the operator calls the node.
    node = int(os.environ.get("LLM_NODE_RANK", os.environ["GROUP_RANK"]))
    me = {
        "rank": rank,
        "local_rank": local_rank,
        "node": node,
        "host": socket.gethostname(),
        "matmul_ms": _matmul_ms(dev),
    }
    ranks: list = [None] * world
    collectives.all_gather_object(ranks, me)
    leaders = sorted({r["node"]: r["rank"] for r in sorted(ranks, key=lambda r: -r["rank"])}.values())
    links = _clock_and_link(dev, rank, leaders, args.link_mb)
    result = {
        "world_size": world,
        "backend": dist.get_backend(),
        "ranks_forked": bool(os.environ.get(FORKED)),  # started as training's CPU ranks are (tasks/launch/agent.py)
        **_correctness(dev, world, rank),
        "sizes": [_bandwidth(dev, world, s, args.iters) for s in args.sizes_mb],
    }
    if rank == 0:
        nodes = {}
        for r in ranks:
            n = nodes.setdefault(r["node"], {"node": r["node"], "host": r["host"], "ranks": [], "reachable": True})
            n["ranks"].append(r["rank"])
            if r["rank"] in leaders:  # rank 0's node is the reference: offset 0, no link to itself
                n.update(links.get(r["rank"], {"rtt_ms": 0.0, "clock_offset_ms": 0.0, "link_gbps": None}))
        base = nodes.get(0, {}).get("clock_offset_ms", 0.0)  # re-based on hardware.node_rank 0
        for n in nodes.values():
            n["clock_offset_ms"] -= base
        result.update(ranks=ranks, nodes=[nodes[k] for k in sorted(nodes)], reference_rank0_node=ranks[0]["node"])
    shared = [result]
    collectives.broadcast_object_list(shared, src=0)  # every node gets the report, shared run directory or not
    if local_rank == 0:
        atomic_write_json(args.out, shared[0])
    collectives.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see probe_worker: a rare SIGABRT at exit after destroy_process_group fails torchrun


if __name__ == "__main__":
    main()
