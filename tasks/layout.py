"""The parallel layout: one `Layout` type for the planner's candidates (tasks.planner) and the training run
(resolved from the config when pinned, else from the plan, and checked before any worker starts — every problem
one line). Its field names are the `parallel.*` config keys. A shared layer: torch-free and importing no other
project module, so the planner, the trainer and the stages all stand on it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# ZeRO 0/1 gradient buckets (tasks/parallel/dp.py builds them, the planner costs them): DDP's defaults
# (torch/nn/parallel/distributed.py: _DEFAULT_BUCKET_CAP_MB = 25, the first bucket dist._DEFAULT_FIRST_BUCKET_BYTES =
# 1 MiB): a small first bucket starts communication early in backward.
DP_BUCKET_BYTES = 25 * 1024 * 1024
DP_FIRST_BUCKET_BYTES = 1024 * 1024


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Pipeline stages each pp rank holds: `virtual_stages` with interleaved 1F1B, else one."""
    return virtual_stages if schedule == "interleaved1f1b" else 1


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # 0 plain DP, 1/2/3 ZeRO stage
    recompute: str = "none"  # none | selective | full
    recompute_every: int = 1
    sequence_parallel: bool = True  # only meaningful with tp > 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved1f1b; ignored when pp == 1
    microbatches: int = 0  # per data-parallel rank and optimizer step (0 = local batch / micro_batch, which divides it;
    # set: micro_batch × microbatches = local batch)
    virtual_stages: int = 2  # per rank, for interleaved1f1b only
    micro_batch: int = 1
    global_batch: int = 1
    flash_attention: bool = True  # fused attention: no s×s activations (planner.memory.layer_activation_bytes)
    ep: int = 1  # expert parallelism: experts split over ep ranks of the dp axis (tasks/parallel/ep.py)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or max(1, self.local_batch // self.micro_batch)  # check() refuses a remainder

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def reshard_after_forward(self) -> bool:
        """ZeRO-3 frees each layer's gathered parameters after its forward and gathers them again for backward — but
        not under pipeline parallelism, where every micro-batch would gather them again: there FSDP keeps them from
        the first forward to the last backward, as ZeRO-2 (torchtitan's parallelize_llama: `reshard_after_forward =
        not pp_enabled`). tasks/parallel/fsdp.py runs it; the planner's memory and step time count it."""
        return self.zero >= 3 and self.pp == 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


EXPLICIT_LAYOUT = {  # Layout field → the config key whose explicit value (--set, DAG Params) the plan must not replace
    "zero": "parallel.zero",
    "recompute": "parallel.recompute",
    "pp_schedule": "parallel.pp_schedule",
    "microbatches": "parallel.microbatches",
    "micro_batch": "train.micro_batch",
    "virtual_stages": "parallel.virtual_stages",
    "sequence_parallel": "parallel.sequence_parallel",
    "ep": "parallel.ep",
}


def resolve(cfg, plan_result: dict | None, world: int) -> Layout:
    """Pinned degrees (cfg.parallel.dp/tp/pp > 0) win; unpinned ones come from the planner's choice, else
    tp = pp = 1 and dp fills the world. With a plan, its zero/recompute/schedule/micro-batch apply too, except where
    the config's value was set explicitly (EXPLICIT_LAYOUT: the plan stage searched only that value)."""
    par, train = cfg.parallel, cfg.train
    lay = Layout(
        dp=par.dp,
        tp=par.tp,
        pp=par.pp,
        zero=par.zero,
        recompute=par.recompute,
        recompute_every=par.recompute_every,
        sequence_parallel=par.sequence_parallel,
        pp_schedule=par.pp_schedule,
        microbatches=par.microbatches,
        virtual_stages=par.virtual_stages,
        micro_batch=train.micro_batch,
        global_batch=train.global_batch,
        ep=getattr(par, "ep", 1) or 1,
    )
    chosen = (plan_result or {}).get("parallel") or {}
    explicit = getattr(cfg, "explicit", {})
    if 0 in (par.dp, par.tp, par.pp) and chosen:
        for key in ("dp", "tp", "pp"):
            if getattr(lay, key) == 0 and chosen.get(key):
                setattr(lay, key, int(chosen[key]))
        for key, dotted in EXPLICIT_LAYOUT.items():  # what --set / the DAG's Params set explicitly wins
            if chosen.get(key) not in (None, "") and dotted not in explicit:
                setattr(lay, key, type(getattr(lay, key))(chosen[key]))
    lay.tp = lay.tp or 1
    lay.pp = lay.pp or 1
    lay.dp = lay.dp or max(1, world // (lay.tp * lay.pp))
    m, local = lay.microbatches, lay.local_batch
    if m and "train.micro_batch" not in explicit and lay.global_batch % lay.dp == 0 and local % m == 0:
        lay.micro_batch = local // m  # the split's size; one set explicitly is kept, for check() to compare
    return lay


def known_world(cfg, plan_result: dict | None) -> int | None:
    """dp × tp × pp as resolve() will set them when the data-parallel degree is pinned or planned (tp and pp
    default to 1); None when dp would fill whatever world there is."""
    par = cfg.parallel
    chosen = (plan_result or {}).get("parallel") or {} if 0 in (par.dp, par.tp, par.pp) else {}
    dp, tp, pp = (getattr(par, k) or int(chosen.get(k) or 0) for k in ("dp", "tp", "pp"))
    return dp * (tp or 1) * (pp or 1) if dp else None


def check(lay: Layout, tcfg, seq_len: int, world: int, world_text: str) -> list[str]:
    problems = []
    if lay.world != world:
        problems.append(
            f"parallel: dp {lay.dp} × tp {lay.tp} × pp {lay.pp} = {lay.world} ≠ world size {world} ({world_text})"
        )
    for what, n in (("heads", tcfg.n_heads), ("KV heads", tcfg.n_kv_heads)):
        if n % lay.tp:
            problems.append(f"parallel.tp: {lay.tp} does not divide the model's {n} {what}")
    if lay.tp > 1 and lay.sequence_parallel and seq_len % lay.tp:
        problems.append(f"data.seq_len: {seq_len} is not divisible by parallel.tp {lay.tp} (sequence parallel)")
    n_stages = lay.pp * stages_per_rank(lay.pp_schedule, lay.virtual_stages)
    if lay.pp > 1 and n_stages > tcfg.n_layers:
        extra = f" ({lay.pp} × {lay.virtual_stages} virtual stages)" if n_stages != lay.pp else ""
        problems.append(f"parallel.pp: {n_stages} pipeline stages{extra} exceed the model's {tcfg.n_layers} layers")
    if lay.pp_schedule == "interleaved1f1b" and lay.pp < 2:
        problems.append("parallel.pp_schedule: interleaved1f1b needs parallel.pp >= 2")
    if tcfg.tie_embeddings and lay.pp > 1:
        problems.append(
            f"parallel.pp: {lay.pp} splits the model's tied embeddings (model.tie_embeddings: the first "
            f"and last stage would each hold a copy) — set parallel.pp 1 (dp/tp/zero all train it)"
        )
    problems += moe_problems(lay, tcfg)
    problems += batch_problems(lay)
    if lay.pp > 1 and lay.pp_schedule != "gpipe" and lay.n_microbatches < lay.pp:
        problems.append(
            f"parallel.microbatches: {lay.n_microbatches} micro-batches per step are fewer than the "
            f"{lay.pp} pipeline stages ({lay.pp_schedule} needs >= pp; lower train.micro_batch or "
            f"raise train.global_batch)"
        )
    return problems


def _divisors_text(n: int) -> str:
    low = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    ds = sorted({*low, *(n // d for d in low)})
    return ", ".join(map(str, ds if len(ds) <= 8 else [*ds[:4], "…", *ds[-3:]]))


def batch_problems(lay: Layout) -> list[str]:
    """Each dp rank's batch (train.global_batch / parallel.dp) splits into equal micro-batches: of
    parallel.microbatches when set (train.micro_batch is then that split's size — resolve() sets it unless it was set
    explicitly, and one that disagrees is refused, never ignored), else of exactly train.micro_batch sequences — one
    that does not divide it is refused, never rounded to another size."""
    local, where = lay.local_batch, f"train.global_batch {lay.global_batch} / parallel.dp {lay.dp}"
    if lay.global_batch % lay.dp:
        return [f"train.global_batch: {lay.global_batch} is not divisible by parallel.dp {lay.dp}"]
    if lay.microbatches and local % lay.microbatches:
        return [
            f"parallel.microbatches: {lay.microbatches} does not divide the {local} sequences per dp rank ({where}); "
            f"set it to one that does ({_divisors_text(local)}), or 0 (train.micro_batch sets it)"
        ]
    if lay.microbatches and lay.micro_batch * lay.microbatches != local:
        m, mb = lay.microbatches, lay.micro_batch
        agree = [f"train.micro_batch {local // m}", *([f"parallel.microbatches {local // mb}"] * (local % mb == 0))]
        return [
            f"train.micro_batch: {mb} × parallel.microbatches {m} = {mb * m} ≠ the {local} sequences per dp rank "
            f"({where}); set {' or '.join(agree)}, or leave one of the two unset"
        ]
    if not lay.microbatches and local % lay.micro_batch:
        return [
            f"train.micro_batch: {lay.micro_batch} does not divide the {local} sequences per dp rank ({where}); "
            f"set it to one that does ({_divisors_text(local)}), or train.global_batch to a multiple of "
            f"{lay.micro_batch * lay.dp}"
        ]
    return []


def moe_problems(lay: Layout, tcfg) -> list[str]:
    """Mixture-of-experts constraints: expert parallelism is carved from dp (inside each pipeline stage, at each
    TP coordinate) and composes with ZeRO 0-3, TP (attention and shared expert split; routed experts whole on
    every TP rank) and PP (tasks/parallel/ep.py)."""
    problems = []
    n_exp = getattr(tcfg, "n_experts", 0)
    if lay.ep > 1 and not n_exp:
        problems.append(
            f"parallel.ep: {lay.ep} needs a mixture-of-experts model (e.g. model.preset moe-demo); set parallel.ep 1"
        )
    if lay.ep > 1 and lay.dp % lay.ep:
        problems.append(
            f"parallel.ep: {lay.ep} does not divide parallel.dp {lay.dp} (expert parallelism is "
            f"carved from the data-parallel ranks)"
        )
    if lay.ep > 1 and n_exp and n_exp % lay.ep:
        problems.append(f"parallel.ep: {lay.ep} does not divide the model's {n_exp} experts")
    shared = getattr(tcfg, "shared_ffn_dim", 0)
    if n_exp and lay.tp > 1 and shared and shared % lay.tp:
        problems.append(
            f"parallel.tp: {lay.tp} does not divide the shared expert's width {shared} (model.shared_ffn_dim)"
        )
    return problems
