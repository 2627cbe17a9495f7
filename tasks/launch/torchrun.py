"""torchrun for a stage's ranks on this node: how many processes, the argv, the environment, the bounded run.

The train and profile stages call these; the test fixtures too. One node: `--standalone`; several: torchrun's static
rendezvous at hardware.rdzv_endpoint (every node runs the same stage with its hardware.node_rank; node 0 listens there).
Each rank starts in the host-binding entry point (tasks/launch/binding.py) unless hardware.bind_cpus is off. CPU ranks
are forked by tasks/launch/agent.py (torchrun's own agent, `--start-method fork`, after the imports every rank needs);
device ranks are exec'd by torch.distributed.run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tasks.config import REPO_ROOT, PipelineConfig
from tasks.launch import binding


def world(cfg: PipelineConfig, plan: dict | None = None):
    """(backend, processes per node, world size): hardware.nproc_per_node when pinned (> 0); else one per device,
    and on CPU the layout's dp × tp × pp (pinned degrees or the plan's; 2 when the dp degree is open)."""
    from tasks.device import detect
    from tasks.layout import known_world

    hw = cfg.hardware
    backend = detect(hw.device)
    nproc = hw.nproc_per_node or (backend.device_count if backend.is_accelerator else 0)
    if not nproc:
        ranks = known_world(cfg, plan)
        nproc = ranks // hw.nnodes if ranks and ranks % hw.nnodes == 0 else 2
    return backend, nproc, nproc * hw.nnodes


AGENT = "tasks.launch.agent"  # torchrun for CPU ranks, forked (a string: this module does not import torch)


def launcher(backend: str) -> list[str]:
    """The interpreter's arguments that start torchrun for `backend`'s ranks: AGENT forks CPU ranks (it takes
    torch.distributed.run's arguments); torch.distributed.run exec's device ranks."""
    return ["-u", "-m", AGENT] if backend == "cpu" else ["-m", "torch.distributed.run"]


def argv(
    cfg: PipelineConfig,
    nproc: int,
    spec_paths: list[Path],
    rdzv_id: str,
    log_dir: Path | None = None,
    *,
    backend: str,
) -> list[str]:
    """torchrun as an argv list: standalone on one node, the static rendezvous across nodes. `log_dir` keeps the
    ranks' @record error files (tasks.parallel.rank_errors reads them). `backend` (npu, cuda, cpu): CPU ranks are
    forked by AGENT, which takes torch.distributed.run's arguments; device ranks are exec'd by torch.distributed.run.

    Static, not c10d: the c10d (dynamic) rendezvous ignores --node-rank (torch/distributed/run.py warns "node_rank is
    only used for static rdzv_backend") and numbers the nodes by host name and process id (dynamic_rendezvous.py
    sorts its participants), so global rank 0 could start on node 1, whose launcher has no MLflow run (env()) and
    whose stage does not write the stage's results. The static rendezvous takes --node-rank as the node's group rank
    (run.py: rdzv_configs["rank"] = node_rank), and the agent gives group rank g the global ranks g × nproc …
    (elastic/agent/server/api.py, _assign_worker_ranks): node_rank 0 holds global rank 0. Its TCPStore listens on
    node 0 at the endpoint (static_tcp_rendezvous.py: is_master = rank 0), so hardware.rdzv_endpoint must be node 0's
    address; the job is fixed-size (--nnodes N, no restarts), as every stage here is."""
    hw = cfg.hardware
    out = [sys.executable, *launcher(backend), "--nproc-per-node", str(nproc), "--max-restarts", "0"]
    if log_dir is not None:
        out += ["--log-dir", str(log_dir)]
    if hw.nnodes == 1:
        out.append("--standalone")
    else:
        out += [
            "--nnodes",
            str(hw.nnodes),
            "--node-rank",
            str(hw.node_rank),
            "--rdzv-backend",
            "static",
            "--rdzv-endpoint",
            hw.rdzv_endpoint,
            "--rdzv-id",
            rdzv_id,
        ]
    # ranks on the cores nearest their device (hardware.bind_cpus)
    out += binding.launch_args(cfg) + binding.entry(cfg)
    for p in spec_paths:
        out += ["--spec", str(p)]
    return out


def env(cfg: PipelineConfig, backend_kind: str, nproc: int) -> dict:
    """torchrun's environment: this one, the repository on PYTHONPATH, the backend's variables (HCCL, allocator,
    CANN logs; tasks.device.launch_env) and the binding plan. No rank is handed an MLflow run: the stage process
    sends rank 0's metrics.jsonl to its own (tasks.parallel.metrics.MetricsFollower)."""
    from tasks.device import DIST_BACKEND, Backend, launch_env

    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), out.get("PYTHONPATH", "")]))
    # OMP_NUM_THREADS is left to torchrun: 1 unless set when it starts 2+ ranks on the node (more OpenMP threads than
    # free cores makes CPU ranks spin-wait, measured 10-30x slower steps on a busy 2-core host); unset for 1 rank,
    # which then uses the host's cores (torch/distributed/run.py, `nproc_per_node > 1`).
    out.update(launch_env(Backend(backend_kind, DIST_BACKEND[backend_kind], nproc), cfg.hardware))
    out.pop("MLFLOW_RUN_ID", None)  # one this process inherited is not the ranks' (the stage sends their metrics)
    binding.prepare(cfg, backend_kind, nproc, out)
    return out


def run(argv: list[str], env: dict, log_path: Path, timeout: tuple[int, str] | None = None) -> tuple[int, str]:
    """Run torchrun to completion within `timeout` (seconds, how derived; tasks/bounds.py), in its own process
    group that dies with this process (tasks.procs); its own output (rendezvous, failure report) goes to log_path.
    On expiry the whole torchrun tree is killed, with the cause. Returns (exit code, log_path's text)."""
    from tasks.bounds import run_bounded

    seconds, how = timeout or (None, "")
    rc = run_bounded(argv, env=env, cwd=REPO_ROOT, log_path=log_path, timeout_s=seconds, what="torchrun", how=how)
    return rc, log_path.read_text(encoding="utf-8", errors="replace")
