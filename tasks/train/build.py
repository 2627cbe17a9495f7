"""The trainer's build steps, in the order `Trainer.__init__` calls them; each owns one thing and returns it.

build_mesh       → the DeviceMesh (pp, dp, tp; with expert parallelism pp, dp_rep, ep, tp)
choose_resume    → the checkpoint to resume from (rank 0 decides, everyone hears)
build_model      → this rank's model parts: meta init → converters → PP split → parallelize → materialise
build_optimizer  → AdamW + LR schedule per part, and the ZeRO 0/1 replica groups and owners
build_step       → the TrainStep (tasks/train/step.py) over those parts
build_loader     → this rank's ShardLoader
"""

from __future__ import annotations

from dataclasses import dataclass, field


def build_mesh(lay, device_type: str):
    """The one DeviceMesh of the run (tasks/parallel/mesh.py; with ep > 1 tasks/parallel/ep.py)."""
    if lay.ep > 1:
        from tasks.parallel.ep import build_mesh as build_ep_mesh

        return build_ep_mesh(device_type, lay.pp, lay.dp, lay.tp, lay.ep)
    from tasks.parallel.mesh import build_mesh as build_dense_mesh

    return build_dense_mesh(device_type, lay.pp, lay.dp, lay.tp)


def choose_resume(spec: dict, ckpt, rank: int, log) -> str | None:
    """The checkpoint this run resumes from, or None. Rank 0 decides and tells everyone (no rank reads the directory
    while rank 0 may be restoring a step-N.old in it): the launcher's verified choice (spec["resume_from"]), else the
    newest checkpoint that verifies; none with spec["resume"] false. Rank 0 also removes a killed save's leftovers."""
    from tasks import collectives

    from tasks.parallel.checkpoint import latest_verified

    decision = [None]
    if rank == 0:
        ckpt.remove_partial()
        if "resume_from" in spec or not spec.get("resume", True):
            decision[0] = spec.get("resume_from") if spec.get("resume", True) else None
        else:
            found, skipped = latest_verified(ckpt.dir)
            for note in skipped:
                log(f"skipping checkpoint {note}")
            decision[0] = str(found[1]) if found else None
    collectives.broadcast_object_list(decision, src=0)
    return decision[0]


@dataclass
class ModelParts:
    """This rank's share of the model: (pipeline stage index, module) pairs (one pair without PP)."""

    stages: list[tuple[int, object]]
    n_stages: int
    converters: list = field(default_factory=list)  # the model converters applied (tasks/model/converters.py)

    @property
    def modules(self) -> list:
        return [m for _, m in self.stages]


def build_model(
    tcfg, lay, mesh, device, precision: str, seed: int, init_from: str | None = None, converters=(), compiled=False
) -> ModelParts:
    """Model parts of this rank: the model on the meta device → model converters (tasks/model/converters.py, in
    model.converters order: NPU kernels, …) → split for PP → `parallelize` each part (`compiled`: torch.compile per
    block) → materialise (each rank allocates and writes only its local shards: seeded random init, or the slices of
    the HF checkpoint `init_from` that it owns)."""
    from tasks.model import build_model as build_meta_model
    from tasks.model import materialize
    from tasks.model.converters import apply
    from tasks.model.init import HFWeights
    from tasks.parallel.mesh import coords
    from tasks.layout import stages_per_rank
    from tasks.parallel.pp import split_model

    if compiled:  # a process that trains several runs in turn (the tests) must not pile graphs up to dynamo's
        import torch  # recompile limit, past which it would run the blocks eagerly

        torch._dynamo.reset()
    model = build_meta_model(tcfg, "meta")
    source = HFWeights(init_from, tcfg) if init_from else None
    apply(model, converters)  # before any parallelism, as torchtitan's converters
    per_rank = stages_per_rank(lay.pp_schedule, lay.virtual_stages)
    stages = split_model(model, coords(mesh)["pp"], lay.pp, per_rank) if lay.pp > 1 else [(0, model)]
    for _, part in stages:
        parallelize(part, lay, mesh, precision, device.type if compiled else None)
        materialize(part, device, seed, source=source)
    return ModelParts(stages, lay.pp * per_rank, list(converters))


def parallelize(part, lay, mesh, precision: str, compile_for: str | None = None) -> None:
    """One model part, in torchtitan's order: TP → EP → activation checkpointing → torch.compile per block (for
    device type `compile_for`, when given: tasks/parallel/compile.py) → data parallelism (FSDP2 for ZeRO 2/3; ZeRO
    0/1 keep replicated parameters: tasks/parallel/dp.py)."""
    from tasks.parallel.ac import apply_ac
    from tasks.parallel.fsdp import apply_fsdp
    from tasks.parallel.tp import apply_tp

    if lay.tp > 1:
        apply_tp(part, mesh["tp"], lay.sequence_parallel)
    if lay.ep > 1:  # experts Shard(0) over "ep", all-to-all dispatch (tasks/parallel/ep.py)
        from tasks.parallel.ep import apply_ep

        apply_ep(part, mesh, lay.ep)
    apply_ac(part, lay.recompute, lay.recompute_every)
    if compile_for:
        from tasks.parallel.compile import apply_compile

        apply_compile(part, compile_for)
    if lay.zero >= 2:
        apply_fsdp(part, mesh["dp"], precision, lay.reshard_after_forward, mesh["dp_rep"] if lay.ep > 1 else None)


@dataclass
class Optimizers:
    """(AdamW, LambdaLR) per model part; for ZeRO 0/1 the replica groups whose gradients are averaged and, for ZeRO 1,
    each parameter's owner {name: (owner's rank in its group, group)}."""

    pairs: list
    replicas: list[dict]
    owner: dict


def build_optimizer(parts: list, named: list, mesh, lay, train_cfg) -> Optimizers:
    """AdamW + warm-up/cosine schedule per part (tasks/parallel/optim.py). Replicated data parallelism (ZeRO 0/1):
    gradients averaged, ZeRO-1 owners chosen, per group of replicas — all dp ranks for most parameters; under expert
    parallelism the dp/ep replicas of the same experts."""
    from tasks.parallel.dp import owners
    from tasks.parallel.optim import build_optimizers

    replicas = dp_replica_groups(named, mesh, lay) if lay.zero < 2 and lay.dp > 1 else []
    owner = {}
    if lay.zero == 1:
        for group in replicas:
            owner.update({k: (v, group) for k, v in owners(group["named"], group["size"]).items()})
    owned = None if not owner else {n for n, _ in named if n not in owner or owner[n][0] == owner[n][1]["rank"]}
    return Optimizers(build_optimizers(parts, train_cfg, owned=owned), replicas, owner)


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


def _losses(precision: str, compiled: bool, device_type: str):
    """(the loss, the pipeline schedule's loss, fp16's loss scaler or None): the loss compiled with the blocks
    (`compiled`); under fp16 the schedule's loss is scaled before its backward (PlainStep scales its own)."""
    from tasks.model import lm_loss

    plain_loss = lm_loss
    if compiled:
        from tasks.parallel.compile import compile_loss

        plain_loss = compile_loss(lm_loss, device_type)
    if precision != "fp16":
        return plain_loss, plain_loss, None
    from tasks.train.loss_scale import LossScaler

    scaler = LossScaler()

    def scaled_loss(logits, targets):
        return plain_loss(logits, targets) * scaler.scale

    return plain_loss, scaled_loss, scaler


def build_step(
    model: ModelParts, opts: Optimizers, mesh, lay, device, precision: str, grad_clip: float, compiled: bool = False
):
    """The TrainStep over this rank's parts: PlainStep (micro-batches) or PipelineStep (a schedule), bf16/fp16 autocast
    for ZeRO 0/1 (fp32 parameters; FSDP's MixedPrecisionPolicy does it for 2/3), fp16's loss scaler, the loss function
    compiled with the blocks (`compiled`, as torchtitan's compile components "model" and "loss"), the loss averaged
    over all ranks, gradients averaged over the replica groups (bucketed, overlapping backward), ZeRO-1 owners
    broadcasting their updated parameters."""
    import torch

    from tasks.model.converters import post_optimizer
    from tasks.parallel.dp import GradBuckets, broadcast_params
    from tasks.parallel.pp import build_schedule
    from tasks.train.step import PipelineStep, PlainStep, TrainStep, global_loss

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision) if lay.zero < 2 else None
    autocast = (lambda: torch.autocast(device.type, dtype=low)) if low else None
    plain_loss, loss_fn, scaler = _losses(precision, compiled, device.type)
    scale = 1.0  # what the forward/backward multiplies the gradients by after backward
    if lay.pp > 1:
        pp_group = mesh["pp"].get_group()
        sched = build_schedule(
            lay.pp_schedule, model.stages, model.n_stages, device, pp_group, lay.n_microbatches, loss_fn
        )
        forward_backward = PipelineStep(sched, [i for i, _ in model.stages], model.n_stages, autocast, scaler)
        scale = 1.0 / lay.n_microbatches if getattr(sched, "scale_grads", False) else 1.0
    else:
        pp_group = None
        forward_backward = PlainStep(model.modules[0], lay.n_microbatches, autocast, plain_loss, scaler)
    if scaler is not None:  # FP16: the MoE aux loss's gradient scaled like the LM loss (tasks/model/moe.py)
        from tasks.model.moe import set_loss_scaler

        for part in model.modules:
            set_loss_scaler(part, scaler)

    # Replicated data parallel: each replica group's gradients all-reduced in buckets from backward hooks (one
    # backward per micro-batch through every parameter), finished before clipping.
    reducers = [
        GradBuckets([p for _, p in g["named"]], g["group"], g["size"], lay.n_microbatches, scale) for g in opts.replicas
    ]

    def grad_sync():
        for reducer in reducers:
            reducer.finish()

    def broadcast_owned():  # ZeRO-1: each owner's updated parameters to the other replicas
        for group in opts.replicas:
            broadcast_params(group["named"], {n: opts.owner[n][0] for n, _ in group["named"]}, group["group"])

    def converters_hook():  # converters whose state follows the weights (fake-quant scales, …)
        post_optimizer(model.converters, model.modules)

    return TrainStep(
        forward_backward,
        opts.pairs,
        [p for part in model.modules for p in part.parameters()],
        grad_clip,
        reduce_loss=lambda loss: global_loss(loss, lay.dp, lay.tp),
        grad_sync=grad_sync if opts.replicas else None,
        pp_group=pp_group,
        after_update=([broadcast_owned] if opts.owner else []) + ([converters_hook] if model.converters else []),
        scaler=scaler,
    )


def build_loader(spec: dict, cfg, lay, dp_rank: int, device):
    """This rank's ShardLoader: its slice of each global batch, workers/pinning from its cores (binding.py)."""
    from data_prep.loader import ShardLoader
    from tasks.parallel.affinity import loader_options

    return ShardLoader(
        spec["shard_dir"],
        "train",
        batch_size=lay.local_batch,
        dp_rank=dp_rank,
        dp_world=lay.dp,
        **loader_options(cfg, device),
        seed=cfg.train.seed,
        verify_sha256=cfg.data.verify_sha256 and not spec.get("shards_verified"),
    )
