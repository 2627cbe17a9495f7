"""Per-rank training entry, started by torchrun: `python -m tasks.parallel.worker --spec launch.json [--spec …]`.

The spec (written by tasks/stages/train.py) holds the resolved config, model shape, layout and paths. Several specs run
one after another in the same process group (the tests use this to check many layouts per torchrun launch).
Exit codes: 0 done, 3 non-finite loss/gradient, 4 out of memory, 5 collective timeout, 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

from tasks.units import GB

EXIT_NONFINITE, EXIT_OOM, EXIT_TIMEOUT = 3, 4, 5
# Fault injection for resilience tests: "RANK:STEP" makes that rank SIGKILL itself at the start of that step,
# "RANK:STEP:hang" makes it stop responding there (the others then hit the collective timeout).
FAULT_ENV = "LLM_PIPELINE_FAULT"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} rank {os.environ.get('RANK', '0')}] {msg}", flush=True)


def _redirect_output(log_path: Path) -> None:
    """stdout/stderr of this rank (including C++ warnings and tracebacks) go to <run-dir>/logs/rank-K.log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def parse_fault(text: str) -> tuple[int, int, str] | None:
    """$LLM_PIPELINE_FAULT → (rank, step, "kill" | "hang"), None when unset; ValueError (one line) when malformed —
    a typo must not silently run without the fault a test or drill asked for."""
    if not text.strip():
        return None
    parts = text.strip().split(":")
    if (
        len(parts) not in (2, 3)
        or not all(p.isdigit() for p in parts[:2])
        or (len(parts) == 3 and parts[2] not in ("kill", "hang"))
    ):
        raise ValueError(
            f"{FAULT_ENV}={text!r} is malformed: expected RANK:STEP or RANK:STEP:kill|hang "
            f"(e.g. 1:4); unset it for a normal run"
        )
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "kill"


def _fault(rank: int) -> tuple[int | None, str]:
    """(step, "kill" | "hang") for this rank from $LLM_PIPELINE_FAULT, or (None, "")."""
    fault = parse_fault(os.environ.get(FAULT_ENV, ""))
    if fault and fault[0] == rank:
        return fault[1], fault[2]
    return None, ""


def _load_spec(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def build_parts(
    tcfg, lay, mesh, c, device, precision: str, seed: int, init_from: str | None = None, npu_kernels: str = "auto"
):
    """Model parts of this rank: NPU kernels → split for PP → TP → activation checkpointing → FSDP → materialise
    (each rank allocates and writes only its local shards: seeded random init, or the slices of the HF checkpoint
    `init_from` that it owns)."""
    from tasks.model.init import HFWeights

    from tasks.model import build_model, materialize
    from tasks.model.npu_kernels import convert as convert_npu_kernels
    from tasks.parallel.ac import apply_ac
    from tasks.parallel.fsdp import apply_fsdp
    from tasks.parallel.pp import split_model, stages_per_rank
    from tasks.parallel.tp import apply_tp

    model = build_model(tcfg, "meta")
    source = HFWeights(init_from, tcfg) if init_from else None
    convert_npu_kernels(model, device.type, npu_kernels)  # NPU fused ops before any parallelism; identity elsewhere
    per_rank = stages_per_rank(lay.pp_schedule, lay.virtual_stages)
    indexed = split_model(model, c["pp"], lay.pp, per_rank) if lay.pp > 1 else [(0, model)]
    ep = getattr(lay, "ep", 1)
    for _, part in indexed:
        if lay.tp > 1:
            apply_tp(part, mesh["tp"], lay.sequence_parallel)
        if ep > 1:  # experts Shard(0) over "ep", all-to-all dispatch (tasks/parallel/ep.py)
            from tasks.parallel.ep import apply_ep

            apply_ep(part, mesh, ep)
        apply_ac(part, lay.recompute, lay.recompute_every)
        if lay.zero >= 2:  # ZeRO 2/3: FSDP2; 0/1: replicated parameters (tasks/parallel/dp.py)
            apply_fsdp(part, mesh["dp"], precision, lay.zero, mesh["dp_rep"] if ep > 1 else None)
        materialize(part, device, seed, source=source)
    return indexed, lay.pp * per_rank


def setup(spec: dict, device) -> SimpleNamespace:
    """Mesh, model parts, optimizers, step function, loader and checkpoint manager of this rank; resumes from the
    latest complete checkpoint (or spec["resume_from"])."""
    import torch
    import torch.distributed as dist

    from data_prep.errors import DataPrepError
    from data_prep.loader import ShardLoader
    from tasks.parallel.binding import loader_options  # workers from this rank's cores, pin_memory, prefetch
    from tasks.config import PipelineConfig, apply_overrides
    from tasks.model import TransformerConfig, flops_per_token, lm_loss
    from tasks.parallel.checkpoint import CheckpointManager, latest_verified
    from tasks.parallel.dp import owners
    from tasks.parallel.layout import Layout
    from tasks.parallel.mesh import build_mesh, coords, layout_name
    from tasks.parallel.metrics import Heartbeat, MetricsLog, PhasePeaks, peak_flops
    from tasks.parallel.optim import build_optimizers
    from tasks.parallel.pp import build_schedule
    from tasks.parallel.step import PipelineStep, PlainStep

    cfg = apply_overrides(PipelineConfig(), {k: v for k, v in spec["config"].items() if k != "preset"})
    tcfg, lay = TransformerConfig(**spec["model"]), Layout(**spec["layout"])
    run_dir = Path(spec["run_dir"])
    rank, world = dist.get_rank(), dist.get_world_size()
    _redirect_output(run_dir / "logs" / f"rank-{rank}.log")
    phases = PhasePeaks(device)
    phases.enter("init")
    if lay.ep > 1:
        from tasks.parallel.ep import build_mesh as build_ep_mesh

        mesh = build_ep_mesh(device.type, lay.pp, lay.dp, lay.tp, lay.ep)
    else:
        mesh = build_mesh(device.type, lay.pp, lay.dp, lay.tp)
    c = coords(mesh)
    _log(
        f"layout {layout_name(lay.dp, lay.tp, lay.pp)}{f'·ep{lay.ep}' if lay.ep > 1 else ''} coords {c} device {device}"
    )
    torch.manual_seed(cfg.train.seed)
    ckpt = CheckpointManager(run_dir / "checkpoints", cfg.train.keep_checkpoints, rank, c, lay.dp, world)
    # Rank 0 decides what to resume from and tells everyone (no rank reads the directory while rank 0 may be
    # restoring a step-N.old in it): the launcher's verified choice, else the newest checkpoint that verifies.
    decision = [None]
    if rank == 0:
        ckpt.remove_partial()
        if "resume_from" in spec or not spec.get("resume", True):
            decision[0] = spec.get("resume_from") if spec.get("resume", True) else None
        else:
            found, skipped = latest_verified(ckpt.dir)
            for note in skipped:
                _log(f"skipping checkpoint {note}")
            decision[0] = str(found[1]) if found else None
    dist.broadcast_object_list(decision, src=0)
    source = decision[0]
    # A training checkpoint wins; without one, model.hf_path's weights (if set) are the starting point.
    init_from = None if source else spec.get("init_from")
    if init_from:
        _log(f"initialising from {init_from}")
    indexed, n_stages = build_parts(
        tcfg, lay, mesh, c, device, cfg.train.precision, cfg.train.seed, init_from, cfg.model.npu_kernels
    )
    parts = [p for _, p in indexed]
    named = [(n, p) for part in parts for n, p in part.named_parameters()]
    # Replicated data parallelism (ZeRO 0/1): gradients averaged, ZeRO-1 owners chosen, per group of replicas —
    # all dp ranks for most parameters; under expert parallelism the dp/ep replicas of the same experts.
    replicas = dp_replica_groups(named, mesh, lay) if lay.zero < 2 and lay.dp > 1 else []
    owner = {}
    if lay.zero == 1:
        for group in replicas:
            owner.update({k: (v, group) for k, v in owners(group["named"], group["size"]).items()})
    optimizers = build_optimizers(
        parts,
        cfg.train,
        owned=None if not owner else {n for n, _ in named if n not in owner or owner[n][0] == owner[n][1]["rank"]},
    )
    # ZeRO 0/1 keep fp32 parameters: bf16 compute comes from autocast (FSDP's MixedPrecisionPolicy does it for 2/3).
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if lay.zero < 2 and cfg.train.precision == "bf16"
        else None
    )
    if lay.pp > 1:
        sched = build_schedule(
            lay.pp_schedule, indexed, n_stages, device, mesh["pp"].get_group(), lay.n_microbatches, lm_loss
        )
        step_fn = PipelineStep(sched, [i for i, _ in indexed], n_stages, autocast)
    else:
        step_fn = PlainStep(parts[0], lay.n_microbatches, autocast)
    probe = {}
    if lay.pp == 1:  # how much of one layer this rank holds between forward and backward (ZeRO 2 vs 3)
        block = next(iter(parts[0].layers.values()))
        parts[0].register_forward_hook(
            lambda *_: probe.__setitem__(
                "layer_elems_after_forward", sum(_local(p).numel() for p in block.parameters())
            )
        )
        probe["block"] = block
    loader = ShardLoader(
        spec["shard_dir"],
        "train",
        batch_size=lay.local_batch,
        dp_rank=c["dp"],
        dp_world=lay.dp,
        **loader_options(cfg, device),
        seed=cfg.train.seed,
        verify_sha256=cfg.data.verify_sha256 and not spec.get("shards_verified"),
    )
    start, last_good = 0, None
    if source:
        try:
            start, notes = ckpt.load(Path(source), parts, optimizers, loader)
        except DataPrepError as e:  # e.g. loader workers changed: the weights resume, the data stream restarts
            notes = [str(e)]
        last_good = str(source)
        _log(f"resumed from {source} at step {start}" + "".join(f"; {n}" for n in notes))
    dist.barrier()
    phases.enter("train")
    return SimpleNamespace(
        phases=phases,
        cfg=cfg,
        lay=lay,
        spec=spec,
        run_dir=run_dir,
        train_dir=run_dir / "train",
        rank=rank,
        world=world,
        parts=parts,
        params=[p for part in parts for p in part.parameters()],
        optimizers=optimizers,
        named=named,
        owner=owner or None,
        replicas=replicas,
        probe=probe,
        sharding=None,
        moe_layers=([f"layers.{i}.moe" for i in range(tcfg.n_layers) if tcfg.is_moe_layer(i)], tcfg.n_experts),
        dp_group=mesh["dp"].get_group() if lay.dp > 1 else None,
        step_fn=step_fn,
        loader=loader,
        batches=loader.batches(),
        ckpt=ckpt,
        start=start,
        last_good=last_good,
        device=device,
        pp_group=mesh["pp"].get_group() if lay.pp > 1 else None,
        fault=_fault(rank),
        metrics=MetricsLog(run_dir / "metrics.jsonl", start, cfg.tracking.enabled) if rank == 0 else None,
        beat=Heartbeat(run_dir / "train" / "heartbeat", rank),
        flops_tok=flops_per_token(tcfg, cfg.data.seq_len),
        peak=peak_flops(device, cfg.hardware.peak_tflops),
    )


def train(spec: dict, device, profile_dir: str | None = None) -> int:
    import torch.distributed as dist

    from tasks.device import memory_stats
    from tasks.fsutil import atomic_write_json
    from tasks.parallel import diagnosis
    from tasks.profiling.collect import make_profiler

    s = setup(spec, device)
    step = s.start
    try:
        with make_profiler(s.cfg.profile, device.type, profile_dir, s.rank) as prof:
            for step in range(s.start + 1, s.cfg.train.steps + 1):
                if not train_step(s, step):
                    return EXIT_NONFINITE
                prof.step()
    except Exception as e:  # OOM and timeouts leave evidence for the launcher; anything else is a bug
        kind = "oom" if diagnosis.is_oom(e) else "timeout" if diagnosis.is_timeout(e) else None
        if kind is None:
            raise
        _log(f"{kind}: {e}")
        _write_failure(s.train_dir, kind, s.rank, step, memory_stats(device), spec.get("estimate_bytes"), str(e))
        return EXIT_OOM if kind == "oom" else EXIT_TIMEOUT
    s.beat.beat(step, "done")
    train_mem = memory_stats(device)
    phases = s.phases.result()
    train_mem["peak_bytes"] = train_mem["peak_reserved_bytes"] = phases.get("train", train_mem["peak_bytes"])
    peaks, sharding, by_phase = [None] * s.world, [None] * s.world, [None] * s.world
    dist.all_gather_object(peaks, train_mem)
    dist.all_gather_object(sharding, s.sharding)
    dist.all_gather_object(by_phase, phases)
    if s.rank == 0:
        s.metrics.close()
        atomic_write_json(
            s.train_dir / "summary.json",
            {
                "final_step": step,
                "start_step": s.start,
                "checkpoint": s.last_good,
                "memory_per_rank": peaks,
                "sharding_per_rank": sharding,
                "memory_phases_per_rank": by_phase,
                "layout": spec["layout"],
            },
        )
    _log(f"done at step {step}")
    return 0


def export(spec: dict) -> None:
    """The final checkpoint → <run-dir>/hf (HF format), written by all ranks together after the model and optimizer
    are gone: each rank streams its share of the files one tensor at a time (tasks.model.hf_export)."""
    import gc

    import torch.distributed as dist

    from tasks.model import TransformerConfig
    from tasks.model.hf_export import export_from_checkpoint
    from tasks.parallel.checkpoint import latest

    import torch

    from tasks.fsutil import atomic_write_json
    from tasks.parallel.metrics import PhasePeaks

    gc.collect()
    _release_freed_memory()
    phases = PhasePeaks(torch.device("cpu"))  # the export runs on the host whatever the training device
    phases.enter("export")
    stats = {}
    run_dir = Path(spec["run_dir"])
    found = latest(run_dir / "checkpoints")
    if found is None:
        raise RuntimeError(f"export: no complete checkpoint in {run_dir / 'checkpoints'}")
    _log(f"exporting {found[1]} to {run_dir / 'hf'}")
    export_from_checkpoint(
        found[1],
        TransformerConfig(**spec["model"]),
        run_dir / "hf",
        tokenizer_dir=spec["export"].get("tokenizer_dir"),
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        barrier=dist.barrier,
        file_bytes=spec["export"].get("file_bytes"),
        stats=stats,
    )
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, {**phases.result(), **stats})
    if dist.get_rank() == 0:
        atomic_write_json(run_dir / "train" / "export_memory.json", {"per_rank": by_rank})
    _log("export done")


def _release_freed_memory() -> None:
    """glibc keeps freed heap pages; hand them back (malloc_trim) so the next phase starts from what is in use."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def train_step(s: SimpleNamespace, step: int) -> bool:
    """One optimizer step with its metrics and checkpoint; False when the loss or gradient is not finite (the
    update is skipped, diagnosis.json written)."""
    import torch

    from tasks.device import memory_stats, synchronize
    from tasks.parallel.checkpoint import shaping_config
    from tasks.parallel.dp import all_reduce_grads, broadcast_params
    from tasks.parallel.optim import grad_norm_and_clip
    from tasks.parallel.step import global_loss

    cfg, lay, device = s.cfg, s.lay, s.device
    s.beat.beat(step, "data")
    if step == s.fault[0]:
        _log(f"fault injection: {s.fault[1]} at step {step}")
        if s.fault[1] == "hang":
            time.sleep(24 * 3600)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    x, y = next(s.batches)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    t_data = time.perf_counter() - t0
    s.beat.beat(step, "compute")
    loss = global_loss(s.step_fn(x, y), lay.dp, lay.tp)
    for group in s.replicas:  # replicated data parallel: average gradients over the replicas
        all_reduce_grads([p for _, p in group["named"]], group["group"], group["size"])
    norm = grad_norm_and_clip(s.params, cfg.train.grad_clip, s.pp_group)
    if not (torch.isfinite(loss) and torch.isfinite(norm)):
        _write_nonfinite(s.train_dir, s.rank, step, loss, norm, s.parts, s.last_good)
        return False
    lr = s.optimizers[0][0].param_groups[0]["lr"]
    for opt, sched in s.optimizers:
        opt.step()
        sched.step()
    if s.owner is not None:  # ZeRO-1: each owner's updated parameters to the other replicas
        for group in s.replicas:
            broadcast_params(group["named"], {n: s.owner[n][0] for n, _ in group["named"]}, group["group"])
    s.sharding = _sharding(s)
    for p in s.params:  # a ZeRO-1 optimizer holds only the parameters it owns: clear every gradient here
        p.grad = None
    synchronize(device)
    dt = time.perf_counter() - t0
    moe = moe_metrics(s.parts, *s.moe_layers, lay.tp)
    if s.rank == 0:
        tps = lay.global_batch * cfg.data.seq_len / dt
        s.metrics.log(
            {
                **moe,
                "step": step,
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": norm.item(),
                "tokens_per_s": tps,
                "step_time_s": dt,
                "data_wait_s": t_data,
                "mfu": s.flops_tok * tps / (s.peak * s.world) if s.peak else None,
                "peak_mem_gb": memory_stats(device)["peak_bytes"] / GB,
            }
        )
    if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or step == cfg.train.steps:
        s.beat.beat(step, "checkpoint")
        s.phases.enter("checkpoint")
        meta = {
            "model": s.spec["model"],
            "layout": s.spec["layout"],
            "config_hash": s.spec.get("config_hash", ""),
            "shaping": shaping_config(s.spec["config"]),
        }
        s.last_good = str(s.ckpt.save(step, s.parts, s.optimizers, s.loader, meta))
        s.phases.enter("train")
    return True


def moe_metrics(parts, layer_names: list[str], n_exp: int, tp: int = 1) -> dict:
    """Router statistics of this step summed over all ranks (a collective: every rank calls it): the
    load-balancing loss, the busiest expert's tokens over the mean (worst layer), dropped assignments
    (tasks.model.moe.summarise); {} for a dense model. `layer_names`: every MoE layer of the whole model, so that
    pipeline stages (each holding some of them) add up position by position; the TP ranks of one replica route
    the same tokens, hence the division by tp."""
    import torch
    import torch.distributed as dist

    from tasks.model.moe import collect_stats, summarise

    st = collect_stats(parts)
    if not layer_names:
        return {}
    flat = torch.zeros(len(layer_names) * n_exp + 3, dtype=torch.float64)
    for i, name in enumerate(layer_names):
        if name in st["tokens"]:
            flat[i * n_exp : (i + 1) * n_exp] = st["tokens"][name]
    flat[-3:] = torch.tensor([st["aux_sum"], st["calls"], st["dropped"]], dtype=torch.float64)
    dist.all_reduce(flat)
    flat /= tp
    tokens = {n: flat[i * n_exp : (i + 1) * n_exp] for i, n in enumerate(layer_names)}
    aux, calls, dropped = flat[-3:].tolist()
    out = summarise(tokens, aux, round(calls), round(dropped))
    out["moe_tokens_per_expert"] = {
        n.removeprefix("layers.").removesuffix(".moe"): t.tolist() for n, t in tokens.items()
    }
    return out


def dp_replica_groups(named, mesh, lay) -> list[dict]:
    """ZeRO 0/1: the groups over which gradients are averaged (and ZeRO-1 owners chosen), each {"named", "group",
    "size", "rank"}: every parameter over the dp ranks, except under expert parallelism the routed experts
    (DTensor shards over "ep"), whose replicas are the dp / ep ranks holding the same experts ("dp_rep"; their
    gradient already sums the EP group's tokens, scaled by 1 / ep: tasks/parallel/ep.py)."""
    from tasks.parallel.ep import is_expert_param

    experts = [(n, p) for n, p in named if lay.ep > 1 and is_expert_param(n)]
    rest = [(n, p) for n, p in named if not (lay.ep > 1 and is_expert_param(n))]
    out = [{"named": rest, "group": mesh["dp"].get_group(), "size": lay.dp, "rank": mesh["dp"].get_local_rank()}]
    if experts and lay.dp // lay.ep > 1:  # (one replica of each expert: nothing to average, no one to tell)
        out.append(
            {
                "named": experts,
                "group": mesh["dp_rep"].get_group(),
                "size": lay.dp // lay.ep,
                "rank": mesh["dp_rep"].get_local_rank(),
            }
        )
    return out


def _sharding(s: SimpleNamespace) -> dict:
    """What this rank holds (elements of its local tensors) at the end of a step: evidence of the ZeRO stage."""
    from torch.distributed.tensor import DTensor

    opt_elems = sum(
        _local(t).numel()
        for opt, _ in s.optimizers
        for st in opt.state.values()
        for t in st.values()
        if hasattr(t, "numel") and t.dim() > 0
    )
    return {
        "param_elems": sum(_local(p).numel() for p in s.params),
        "grad_elems": sum(_local(p.grad).numel() for p in s.params if p.grad is not None),
        "optim_elems": opt_elems,
        "full_elems": sum(p.numel() for p in s.params),
        "layer_elems_after_forward": s.probe.get("layer_elems_after_forward"),
        "layer_elems_at_rest": sum(_local(p).numel() for p in s.probe["block"].parameters())
        if "block" in s.probe
        else None,
        "dtensor_params": sum(isinstance(p, DTensor) for p in s.params),
    }


def _write_nonfinite(train_dir: Path, rank: int, step: int, loss, norm, parts, last_good) -> None:
    """Every rank names its parameters with non-finite gradients; rank 0 writes diagnosis.json."""
    import torch
    import torch.distributed as dist

    from tasks.fsutil import atomic_write_json

    bad = [
        n
        for part in parts
        for n, p in part.named_parameters()  # this rank's shard of each gradient
        if p.grad is not None and not torch.isfinite(_local(p.grad)).all()
    ][:10]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    if rank == 0:
        what = "loss became non-finite" if not torch.isfinite(loss) else "gradient norm became non-finite"
        atomic_write_json(
            train_dir / "diagnosis.json",
            {
                "what": what,
                "step": step,
                "loss": float(loss),
                "grad_norm": float(norm),
                "last_good_checkpoint": last_good,
                "nonfinite_grads_by_rank": {str(r): names for r, names in enumerate(everyone) if names},
                "advice": [
                    "lower train.lr or lengthen train.warmup_steps",
                    "keep train.grad_clip > 0",
                    "bf16 overflow: check the first parameter listed; try train.precision fp32 to compare",
                    "bad data: inspect the batch of this step (loader position in the last checkpoint)",
                ],
            },
        )
    _log(f"stopping: non-finite loss/gradient at step {step}")


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _write_failure(train_dir: Path, kind: str, rank: int, step: int, mem: dict, estimate, error: str) -> None:
    from tasks.fsutil import atomic_write_json

    atomic_write_json(
        train_dir / "failures" / f"{kind}-rank-{rank}.json",
        {
            "rank": rank,
            "step": step,
            "memory": mem,
            "estimate_bytes": estimate,
            "error": error.splitlines()[0][:500] if error else "",
        },
    )


def main(argv=None) -> int:
    """@record: a Python exception of this rank goes to the error file torchrun names (TORCHELASTIC_ERROR_FILE),
    where the launcher reads the real cause of the failure (tasks.parallel.rank_errors)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_main)(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", action="append", required=True, help="launch spec JSON (repeatable)")
    parser.add_argument("--profile-dir", default=None, help="profile the steps (tasks.profiling.collect schedule)")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from tasks.device import detect, torch_device
    from tasks.procs import die_with_parent

    die_with_parent(signal.SIGKILL)  # torchrun gone (kill -9) → this rank goes too, never an orphan that trains on
    specs = [_load_spec(p) for p in args.spec]
    hw = specs[0]["config"]["hardware"]
    backend = detect(hw["device"])
    device = torch_device(backend.kind, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend.dist_backend, timeout=timedelta(seconds=specs[0]["config"]["train"]["timeout_s"]))
    code = 0
    for spec in specs:
        code = train(spec, device, args.profile_dir)
        if code:
            break
        if spec.get("export"):
            export(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (0, EXIT_NONFINITE):  # every rank reached the same point: a clean shutdown is possible
        dist.destroy_process_group()
    # os._exit: skips interpreter teardown, which rarely SIGABRTs after destroy_process_group (gloo threads)
    # and would turn a finished run into a failed one.
    os._exit(code)


if __name__ == "__main__":
    main()
