"""Plan the parallel layout: estimate per-device memory and step time for every (dp, tp, pp, ZeRO, recompute,
micro-batch, schedule), rank the ones that fit, explain the rest. The best plan configures training unless the
config pins parallel.dp/tp/pp. What-if questions (another model or cluster) take the flags below.

A custom architecture (`--hidden --layers --heads`, without --model/--hf-config) takes nothing from the config's
model preset: the fields it leaves out come from the `--family` rule (tasks/planner/families.py: Meta's Llama FFN
rounding; Qwen2 has none, so it needs --ffn), and the plan calls it `custom`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tasks import tracking
from tasks.config import PipelineConfig
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, atomic_write_text
from tasks.planner.cluster import PRESETS as CLUSTERS
from tasks.planner.cluster import get_cluster
from tasks.planner.families import FAMILIES, custom_fields
from tasks.planner.memory import PRECISION_BYTES, num_params
from tasks.planner.search import Problem, search
from tasks.planner.table import render
from tasks.units import GB

_SHAPE_FLAGS = {
    "hidden": "dim",
    "layers": "n_layers",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "vocab": "vocab_size",
    "ffn": "ffn_dim",
}
_MODEL_FLAGS = ("model", "hf_config", "params", "family", *_SHAPE_FLAGS)
_REQUIRED_SHAPE = (("hidden", "dim"), ("layers", "n_layers"), ("heads", "n_heads"))
_CLUSTER_FLAGS = ("cluster", "nodes", "devices_per_node", "device_memory_gb")
_TRAINING_FLAGS = (("seq_len", "seq", "--seq-len"), ("global_batch", "global batch", "--global-batch"))


def _positive(kind, most: float = float("inf")):
    """argparse type: a number > 0 (at most `most`: the bound of the config field the flag stands for); integers
    may be written 13e9."""

    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not (0 < value < float("inf")) or (kind is int and value != int(value)):
            raise argparse.ArgumentTypeError(f"{text} must be a {'whole ' if kind is int else ''}number > 0")
        if value > most:
            raise argparse.ArgumentTypeError(f"{text} must be at most {int(most) if most == int(most) else most}")
        return kind(value)

    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (default: the config's model.*)")
    g.add_argument("--model", default=None, help="tasks.model preset, e.g. llama3-70b")
    g.add_argument("--hf-config", default=None, metavar="PATH", help="an HF config.json (or its directory)")
    g.add_argument(
        "--params",
        type=_positive(float),
        default=None,
        metavar="N",
        help="bare parameter count (13e9): model states only",
    )
    for flag in _SHAPE_FLAGS:
        g.add_argument(
            f"--{flag.replace('_', '-')}",
            type=_positive(int),
            default=None,
            help="a shape number (with --model/--hf-config: overrides it; alone: a custom model)",
        )
    g.add_argument(
        "--family",
        choices=FAMILIES,
        default=None,
        help="rule for what a custom --hidden/--layers/--heads model leaves out (default llama3)",
    )
    g = parser.add_argument_group("cluster (default: the config's hardware.*)")
    g.add_argument("--cluster", default=None, choices=sorted(CLUSTERS), help="cluster preset")
    g.add_argument("--nodes", type=_positive(int, 4096), default=None)
    g.add_argument("--devices-per-node", type=_positive(int, 1024), default=None)
    g.add_argument("--device-memory-gb", type=_positive(float, 1e5), default=None)
    g = parser.add_argument_group("training (default: data.seq_len, train.*, parallel.*, plan.*)")
    g.add_argument("--seq-len", type=_positive(int, 1 << 20), default=None)
    g.add_argument("--global-batch", type=_positive(int, 1 << 24), default=None)
    g.add_argument(
        "--micro-batch", type=_positive(int, 1 << 20), default=None, help="fix the micro-batch (default: search)"
    )
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None, help="fix the ZeRO stage")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default=None)
    g.add_argument("--dp", type=_positive(int), default=None, help="pin the data-parallel degree")
    g.add_argument("--tp", type=_positive(int), default=None, help="pin the tensor-parallel degree")
    g.add_argument("--pp", type=_positive(int), default=None, help="pin the pipeline-parallel degree")
    g.add_argument("--precision", choices=sorted(PRECISION_BYTES), default=None)
    g.add_argument("--optimizer", choices=["adamw", "sgd"], default=None, help="default: train.optimizer")


def _arg(ctx, name):
    return getattr(ctx.args, name, None)


def _training_source(ctx) -> str:
    """A what-if plan (another model or cluster by flag) whose sequence length or global batch is the config's (the
    CPU demo's 128-token batches by default): said on the table's training line, with the flags that change it."""
    what_if = any(_arg(ctx, f) is not None for f in _MODEL_FLAGS + _CLUSTER_FLAGS)
    missing = {w: flag for f, w, flag in _TRAINING_FLAGS if _arg(ctx, f) is None}
    if not (what_if and missing):
        return ""
    return f" ({' and '.join(missing)} from the config: {' and '.join(missing.values())} for yours)"


def _model(cfg: PipelineConfig, ctx, seq_len: int):
    """(TransformerConfig or None, parameter count, description) from the flags or the config."""
    if _arg(ctx, "params") is not None:
        other = [f for f in _MODEL_FLAGS if f != "params" and _arg(ctx, f) is not None]
        if other:  # --params has no shape: the others would be dropped without a word
            flags = ", ".join("--" + f.replace("_", "-") for f in other)
            raise StageError(f"--params: a bare parameter count, not with {flags}; give one or the other")
        n = _arg(ctx, "params")
        return None, n, f"{_count(n)} params (model states only: no shape, so no activations)"
    from tasks.model.resolve import from_pipeline
    from tasks.shape import TransformerConfig

    shape = {field: _arg(ctx, flag) for flag, field in _SHAPE_FLAGS.items() if _arg(ctx, flag) is not None}
    family = _arg(ctx, "family")
    if family and (not shape or _arg(ctx, "model") or _arg(ctx, "hf_config")):
        raise StageError(
            "--family: only for a custom architecture (--hidden, --layers, --heads without --model or --hf-config)"
        )
    rule = ""
    if _arg(ctx, "hf_config"):
        tcfg, name = _hf_config(Path(_arg(ctx, "hf_config"))), _arg(ctx, "hf_config")
    elif _arg(ctx, "model"):
        tcfg, name = TransformerConfig.from_preset(_arg(ctx, "model")), _arg(ctx, "model")
    elif shape:  # a custom architecture: nothing comes from the config's model preset
        missing = [f"--{flag}" for flag, field in _REQUIRED_SHAPE if field not in shape]
        if missing:
            raise StageError(
                f"{', '.join(missing)}: a custom architecture needs --hidden, --layers and --heads "
                f"(the rest from --family {family or 'llama3'} or its own flags), or --model PRESET "
                "to change a preset"
            )
        derived, rule = custom_fields(family or "llama3", shape["dim"], shape["n_heads"], shape)
        tcfg, name = TransformerConfig(**derived, **shape), "custom"
    else:
        vocab, vocab_from = _vocab(cfg, ctx)
        # the planned length need not fit the model's RoPE table (only its shape matters): what training would refuse
        # is a warning in run() (_seq_len_warning)
        tcfg = from_pipeline(cfg, vocab_size=vocab, check_seq_len=False, vocab_from=vocab_from)
        name = cfg.model.hf_path or cfg.model.preset
    if tcfg.n_experts and shape:  # the MoE planner takes no shape flags: refused, never a silent dense model
        raise StageError(
            f"{', '.join('--' + f.replace('_', '-') for f, v in _SHAPE_FLAGS.items() if v in shape)}: {name} is a "
            "mixture of experts, which shape flags cannot change here; plan it with --config PRESET --set "
            "model.n_layers=… (model.dim, model.n_experts, …)"
        )
    if shape and name != "custom":  # a preset or HF config with some numbers changed is a custom model too
        if "n_heads" in shape and "n_kv_heads" not in shape:
            shape["n_kv_heads"] = shape["n_heads"]  # explicit heads without --kv-heads: plain multi-head attention
        rule, name = f"from {name}", "custom"
    tcfg = dataclasses.replace(tcfg, **shape).validate()
    n = num_params(tcfg)
    return (
        tcfg,
        n,
        (
            f"{name} ({_count(n)} params, h {tcfg.dim}, L {tcfg.n_layers}, "
            f"heads {tcfg.n_heads}/{tcfg.n_kv_heads} kv, ffn {tcfg.ffn_dim}, vocab {tcfg.vocab_size}"
            f"{'; ' + rule if rule else ''})"
        ),
    )


def _vocab(cfg: PipelineConfig, ctx) -> tuple[int | None, str]:
    """(the tokenizer size the config's model must hold, where it comes from for from_pipeline's lines): the run
    directory's shard set's, else data.vocab_size when the shard stage would train the BPE, else none known."""
    shard = ctx.inputs.get("shard") or {}
    if shard.get("vocab_size"):
        return shard["vocab_size"], ""
    if cfg.data.tokenizer == "train":
        return cfg.data.vocab_size, "data.vocab_size (the BPE tokenizer the shard stage would train; no shard set here)"
    return None, ""


def _count(n: float) -> str:
    """8.03B, 494.03M, 139.58K; a count under a thousand as it is."""
    return next((f"{n / d:.2f}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= d), f"{n:.0f}")


def _read_hf(path: Path) -> tuple[Path, dict]:
    path = path / "config.json" if path.is_dir() else path
    try:
        return path, json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StageError(f"--hf-config {path}: cannot read JSON ({e})") from None


def _hf_config(path: Path):
    """The shape an HF config.json gives; a scaled RoPE (Llama-3.1/3.2/3.3's rope_type llama3) is read as its shape
    (memory and step time do not depend on it), training's refusal of it said by _hf_config_warning."""
    from tasks.shape import config_from_hf

    path, hf = _read_hf(path)
    try:
        return config_from_hf(hf, rope_scaling_ok=True)
    except KeyError as e:
        raise StageError(f"--hf-config {path}: missing key {e}") from None


def _hf_config_warning(ctx) -> str:
    """What training would say of --hf-config's config.json as model.hf_path (its refusal, as tasks.shape words it),
    else ""."""
    from tasks.shape import hf_refusal

    if not _arg(ctx, "hf_config"):
        return ""
    path, hf = _read_hf(Path(_arg(ctx, "hf_config")))
    problem = hf_refusal(hf)
    return f"training would refuse it as model.hf_path: {path}: {problem}" if problem else ""


def _cluster(cfg: PipelineConfig, ctx):
    hw = cfg.hardware
    name = _arg(ctx, "cluster") or hw.cluster
    own = name == hw.cluster  # the config's hardware.* figures describe its own cluster, not another preset
    memory = _arg(ctx, "device_memory_gb")
    if (
        memory
        and not _arg(ctx, "cluster")
        and name in CLUSTERS
        and CLUSTERS[name].kind == "cpu"
        and "hardware.cluster" not in cfg.explicit
    ):
        c = CLUSTERS[name]
        raise StageError(
            f"--device-memory-gb {memory:g} without --cluster would keep the {name} preset's other "
            f"facts ({c.peak_tflops:g} TFLOP/s, {c.intra_gbps:g}/{c.inter_gbps:g} GB/s links): add "
            f"--cluster ({', '.join(k for k, v in CLUSTERS.items() if v.kind != 'cpu')}), or set "
            f"hardware.cluster explicitly"
        )
    node = CLUSTERS.get(name)
    if (
        own
        and node
        and node.kind != "cpu"
        and hw.nproc_per_node > node.devices_per_node
        and not _arg(ctx, "devices_per_node")
    ):  # a node holds no more devices than its preset's: 16 ranks on one 8-NPU node was planned as 1 × 16 devices
        raise StageError(
            f"hardware.nproc_per_node: {hw.nproc_per_node} exceeds the {node.devices_per_node} devices a "
            f"{name} node has (hardware.cluster {name}); set hardware.nproc_per_node <= {node.devices_per_node} and "
            "more hardware.nnodes, or plan another node with --devices-per-node"
        )
    return get_cluster(
        name,
        nodes=_arg(ctx, "nodes") or (hw.nnodes if own else 0),
        devices_per_node=_arg(ctx, "devices_per_node") or (hw.nproc_per_node if own else 0),
        memory_gb=_arg(ctx, "device_memory_gb") or (hw.device_memory_gb if own else 0),
        intra_gbps=hw.intra_node_gbps if own else 0,
        inter_gbps=hw.inter_node_gbps if own else 0,
        intra_latency_us=hw.intra_node_latency_us if own else 0,
        inter_latency_us=hw.inter_node_latency_us if own else 0,
        peak_tflops=hw.peak_tflops if own else 0,
        reserve_gb=cfg.plan.runtime_reserve_gb,
    )


def _fused_attention(cfg: PipelineConfig) -> bool:
    """SDPA is a fused kernel (no s×s scores kept) except on Ascend SoCs older than 910B (no npu_fusion_attention)."""
    from tasks.device import fused_attention_available

    return fused_attention_available(cfg.hardware.cluster)


def _tp_refused(cfg: PipelineConfig) -> str:
    """Why training refuses tensor parallelism with this config (tasks/stages/train.prepare: train.compile,
    tasks/parallel/compile.compile_problem; the qat_int8 converter, tasks/quant/fake_quant.py), else "": the plan
    then plans tp 1 only, never a layout train would refuse."""
    if cfg.train.compile:
        return "tp > 1: train.compile refuses tensor parallelism (set train.compile=false to plan tp > 1)"
    if "qat_int8" in cfg.model.converters:
        return "tp > 1: the qat_int8 converter (model.converters) refuses tensor parallelism; drop it to plan tp > 1"
    return ""


def problem(cfg: PipelineConfig, ctx, config_pins: bool = True) -> tuple[Problem, str, bool]:
    """The planning problem from flags and config; also the model description and whether the config pins the
    whole layout (then its zero/recompute/schedule/micro-batch are taken as they are)."""
    seq_len = _arg(ctx, "seq_len") or cfg.data.seq_len
    shape, n_params, model_desc = _model(cfg, ctx, seq_len)
    what_if = any(_arg(ctx, f) is not None for f in _MODEL_FLAGS + _CLUSTER_FLAGS)
    pins = {k: _arg(ctx, k) for k in ("dp", "tp", "pp") if _arg(ctx, k)}
    if config_pins and not pins and not what_if:  # the config's pins describe its own model and cluster
        pins = {k: getattr(cfg.parallel, k) for k in ("dp", "tp", "pp") if getattr(cfg.parallel, k)}
    if config_pins:  # an explicit --set parallel.dp/tp/pp is pinned like --dp/--tp/--pp, what-if or not: training keeps
        pins.update(_explicit_degrees(cfg, ("dp", "tp", "pp"), pins))  # it (tasks.layout.resolve), so size it
    pinned = config_pins and len(pins) == 3 and not what_if and not any(_arg(ctx, k) for k in ("dp", "tp", "pp"))
    par = cfg.parallel
    # What the user set explicitly (--set, DAG Params) is honoured like the flag of the same name: training keeps it
    # (tasks.layout.resolve), so the plan must size that value, not search over it.
    ex = cfg.explicit
    # parallel.microbatches (explicit, or the pinned config's): training splits each rank's batch into that many, so
    # only micro-batch = local batch / microbatches is sized; a fixed micro-batch must agree with it
    microbatches = par.microbatches if pinned or "parallel.microbatches" in ex else 0
    fixed = _arg(ctx, "micro_batch") or (cfg.train.micro_batch if "train.micro_batch" in ex else None)
    mb = fixed if microbatches else _arg(ctx, "micro_batch") or (cfg.train.micro_batch if pinned else fixed)
    zero, rc = _arg(ctx, "zero"), _arg(ctx, "recompute")
    if zero is None and "parallel.zero" in ex:
        zero = par.zero
    if rc is None and "parallel.recompute" in ex:
        rc = par.recompute
    if shape is None and rc not in (None, "none"):  # --params: no layers, so no activations for recompute to size
        raise StageError(
            f"{'--recompute' if _arg(ctx, 'recompute') else 'parallel.recompute'} {rc}: a plan from --params alone "
            "sizes model states only (no layer shape, no activations), so recompute cannot be planned; give the "
            "model's shape (--model, --hf-config or --hidden/--layers/--heads), or leave it out"
        )
    pb = Problem(
        cluster=_cluster(cfg, ctx),
        shape=shape,
        n_params=n_params,
        seq_len=seq_len,
        global_batch=_arg(ctx, "global_batch") or cfg.train.global_batch,
        precision=_arg(ctx, "precision") or cfg.train.precision,
        optimizer=_arg(ctx, "optimizer") or cfg.train.optimizer,
        micro_batches=[mb] if mb else [],
        microbatches=microbatches,
        zero_stages=[zero] if zero is not None else ([par.zero] if pinned else list(cfg.plan.zero_stages)),
        recompute=[rc] if rc else ([par.recompute] if pinned else list(cfg.plan.recompute)),
        schedules=[par.pp_schedule] if pinned or "parallel.pp_schedule" in ex else list(cfg.plan.schedules),
        virtual=par.virtual_stages,
        recompute_every=par.recompute_every,
        sequence_parallel=par.sequence_parallel,
        flash_attention=cfg.plan.flash_attention and _fused_attention(cfg),
        efficiency=cfg.plan.efficiency,
        pins=pins,
        tp_refused=_tp_refused(cfg),
        kept_schedule=par.pp_schedule if pinned or "parallel.pp_schedule" in ex else "",
    )
    if what_if:
        _check_set_degrees(cfg, ctx, pins, pb.cluster)
    if microbatches:
        world, model = pb.cluster.world, (pins.get("tp") or 1) * (pins.get("pp") or 1)
        dps = [pins["dp"]] if "dp" in pins else [d for d in range(1, world + 1) if world % (d * model) == 0]
        _check_microbatches(pb, dps, "--micro-batch" if _arg(ctx, "micro_batch") else "train.micro_batch")
    return pb, model_desc, pinned


def _explicit_degrees(cfg: PipelineConfig, keys: tuple, given: dict) -> dict:
    """The degrees among `keys` set explicitly (--set, DAG Params) to a pinned value (> 0; ep ≥ 1) and not already in
    `given` (a flag's wins): a what-if keeps them, since training runs them whatever the plan says. A what-if
    cluster they do not divide is refused by the search ("pinned dp 3 does not divide world 16 devices")."""
    par = cfg.parallel
    return {
        k: getattr(par, k) for k in keys if k not in given and f"parallel.{k}" in cfg.explicit and getattr(par, k) > 0
    }


def _check_set_degrees(cfg: PipelineConfig, ctx, pins: dict, cluster) -> None:
    """Degrees set with --set that a what-if cluster cannot run (their product does not divide its devices, or all
    three do not make them): refused in one line, naming the --set values, instead of a plan that drops them."""
    kept = {k: v for k, v in pins.items() if f"parallel.{k}" in cfg.explicit and not _arg(ctx, k)}
    if not kept:
        return
    product, world = 1, cluster.world
    for v in pins.values():
        product *= v
    if world % product == 0 and (len(pins) < 3 or product == world):
        return
    how = "exceeds" if product > world else "does not divide" if world % product else "is not"
    raise StageError(
        f"--set {' '.join(f'parallel.{k}={v}' for k, v in kept.items())}: "
        f"{' × '.join(f'{k} {v}' for k, v in pins.items())}{f' = {product}' if len(pins) > 1 else ''} {how} the "
        f"what-if cluster's {world} devices "
        f"({cluster.nodes}×{cluster.devices_per_node}); training keeps these degrees, so plan a cluster they fit or "
        "leave them out of this plan's --set"
    )


def _check_microbatches(pb, dps: list[int], mb_key: str) -> None:
    """parallel.microbatches that splits the per-rank batch of none of the data-parallel degrees `dps` the search may
    try evenly (or, with a fixed micro-batch, into micro-batches of that size) is refused in one line."""
    m, g = pb.microbatches, pb.global_batch
    fits = [d for d in dps if g % d == 0 and (g // d) % m == 0]
    mb = pb.micro_batches[0] if pb.micro_batches else None
    if mb:
        fits = [d for d in fits if g // d == mb * m]
    if fits:
        return
    per = (
        f"the {g // dps[0]} sequences per dp rank (train.global_batch {g} / parallel.dp {dps[0]})"
        if len(dps) == 1 and g % dps[0] == 0
        else f"train.global_batch {g} / parallel.dp for any dp the plan may try ({', '.join(map(str, dps))})"
    )
    if mb:
        raise StageError(
            f"parallel.microbatches: {m} micro-batches of {mb_key} {mb} do not make {per}; set one so that "
            f"{mb_key} × parallel.microbatches is the per-rank batch, or leave parallel.microbatches 0"
        )
    raise StageError(
        f"parallel.microbatches: {m} does not divide {per}; set it to a divisor of the per-rank batch, or leave it "
        "0 (train.micro_batch sets it)"
    )


def _choose(result: dict, pinned: bool, pb: Problem, model_desc: str, plan_path: Path) -> tuple[dict, str]:
    """The plan training gets, and the stage status; no feasible plan fails in one line (a pinned layout that
    only misses on memory warns instead: the user chose it, and the estimate may be pessimistic)."""
    if result["plans"]:
        return result["plans"][0], "ok"
    rejected = result["rejected"]
    closest = next((r for r in rejected if "total_bytes" in r), rejected[0] if rejected else None)
    if pinned and closest and "total_bytes" in closest:
        return closest, "warn"
    c = pb.cluster
    fix = ""
    if closest and "total_bytes" in closest:  # the cause is memory: name what lowers it
        fix = (
            "; to fit, add devices (hardware.nnodes, or --nodes for a what-if) or memory per device, or plan a "
            f"{'shorter sequence (--seq-len) or a ' if getattr(pb, 'shape', None) is not None else ''}smaller model"
        )
    if closest and "total_bytes" not in closest:  # nothing got as far as memory: every distinct reason counts
        others = list(dict.fromkeys(r["reason"] for r in rejected if r["reason"] != closest["reason"]))
        if others:
            more = f"; +{len(others) - 3} more" if len(others) > 3 else ""
            closest = {"reason": f"{closest['reason']} (also: {'; '.join(others[:3])}{more})"}
    raise StageError(
        f"no feasible plan for {model_desc.split(' (')[0]} on {c.nodes}×{c.devices_per_node} {c.name} "
        f"devices of {c.memory_gb:g} GB: closest {closest['reason'] if closest else 'none tried'}{fix} "
        f"(see {plan_path})"
    )


def _moe_model(cfg: PipelineConfig, ctx):
    """The TransformerConfig when the model to plan is a mixture of experts (planned by tasks/planner/moe.py),
    else None. Shape flags and --params describe dense models."""
    if any(_arg(ctx, f) is not None for f in ("params", "family", *_SHAPE_FLAGS)):
        return None  # shape flags: a custom architecture, or a refusal in _model for a mixture of experts
    from tasks.model.resolve import from_pipeline
    from tasks.shape import TransformerConfig

    if _arg(ctx, "hf_config"):
        tcfg = _hf_config(Path(_arg(ctx, "hf_config")))
    elif _arg(ctx, "model"):
        tcfg = TransformerConfig.from_preset(_arg(ctx, "model"))
    else:
        vocab, vocab_from = _vocab(cfg, ctx)
        tcfg = from_pipeline(cfg, vocab_size=vocab, check_seq_len=False, vocab_from=vocab_from)
    return (
        (tcfg, _arg(ctx, "hf_config") or _arg(ctx, "model") or cfg.model.hf_path or cfg.model.preset)
        if tcfg.n_experts
        else None
    )


_PARALLEL = ("dp", "tp", "pp", "zero", "recompute", "microbatches", "micro_batch")
_BEST = (
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "buffers_bytes",
    "reserve_bytes",
    "total_bytes",
    "step_s",
    "tokens_per_s",
)


def _moe_plan(cfg: PipelineConfig, ctx, tcfg, name: str) -> tuple:
    """A mixture-of-experts model's plan (tasks/planner/moe.py: dp/ep/zero/recompute/micro-batch; tp/pp as the
    config pins them, else 1): what run() needs to finish the stage as for a dense model."""
    from tasks.planner import moe

    what_if = any(_arg(ctx, f) is not None for f in _MODEL_FLAGS + _CLUSTER_FLAGS)
    par, pins = cfg.parallel, {}
    if not what_if:  # the config's pins describe its own model and cluster
        pins = {k: getattr(par, k) for k in ("dp", "ep") if getattr(par, k) > (k == "ep")}
        if "parallel.ep" in cfg.explicit:  # an explicit ep 1 too: training keeps it (EXPLICIT_LAYOUT), so size it
            pins["ep"] = par.ep
    pins.update(_explicit_degrees(cfg, ("dp", "ep"), pins))  # explicit ones, what-if or not (training keeps them)
    if _arg(ctx, "dp"):
        pins["dp"] = _arg(ctx, "dp")
    ex = cfg.explicit
    zero = _arg(ctx, "zero")
    zero = par.zero if zero is None and "parallel.zero" in ex else zero
    rc = _arg(ctx, "recompute") or (par.recompute if "parallel.recompute" in ex else None)
    recompute = [rc] if rc else list(cfg.plan.recompute)
    if "selective" in recompute:
        if rc or recompute == ["selective"]:
            raise StageError(
                f"{'--recompute' if _arg(ctx, 'recompute') else 'parallel.recompute / plan.recompute'} selective: "
                "the mixture-of-experts planner sizes recompute none or full only; choose one of those"
            )
        recompute.remove("selective")
    mb = _arg(ctx, "micro_batch") or (cfg.train.micro_batch if "train.micro_batch" in ex else None)
    tp_pp = {k: getattr(par, k) for k in ("tp", "pp") if not what_if and getattr(par, k) > 1}
    tp_pp.update(_explicit_degrees(cfg, ("tp", "pp"), tp_pp))
    tp_pp.update({k: _arg(ctx, k) for k in ("tp", "pp") if _arg(ctx, k)})
    seq_len = _arg(ctx, "seq_len") or cfg.data.seq_len
    global_batch = _arg(ctx, "global_batch") or cfg.train.global_batch
    pb = moe.MoeProblem(
        _cluster(cfg, ctx),
        tcfg,
        seq_len,
        global_batch,
        precision=_arg(ctx, "precision") or cfg.train.precision,
        optimizer=_arg(ctx, "optimizer") or cfg.train.optimizer,
        capacity_factor=tcfg.capacity_factor,
        zero_stages=[zero] if zero is not None else list(cfg.plan.zero_stages),
        recompute=recompute,
        micro_batches=[mb] if mb else [],
        microbatches=par.microbatches if "parallel.microbatches" in ex else 0,
        recompute_every=par.recompute_every,
        flash_attention=cfg.plan.flash_attention and _fused_attention(cfg),
        efficiency=cfg.plan.efficiency,
        pins=pins,
        sequence_parallel=par.sequence_parallel,
        pp_schedule=par.pp_schedule,
        virtual_stages=par.virtual_stages,
        tp_refused=_tp_refused(cfg),
        **tp_pp,
    )
    if pb.microbatches and pb.cluster.world % (pb.tp * pb.pp) == 0:  # else the search names the pinned tp × pp
        _check_microbatches(
            pb,
            [pb.cluster.world // (pb.tp * pb.pp)],
            "--micro-batch" if _arg(ctx, "micro_batch") else "train.micro_batch",
        )
    result = moe.search(pb)
    desc = (
        f"{name} (MoE: {tcfg.n_experts} experts, top-{tcfg.top_k}, "
        f"{num_params(tcfg) / 1e9:.3g}B params, {num_params(tcfg, active=True) / 1e9:.3g}B active)"
    )
    header = (
        f"model: {desc}\ncluster: {pb.cluster.describe()}\n"
        f"training: seq {seq_len}, global batch {global_batch}{_training_source(ctx)}"
    )
    doc = {"model": desc, "moe": True, "pins": pins, "chosen": (result["plans"] or [None])[0], **result}
    return pb, desc, doc, moe.render(result, header, cfg.plan.top_k), result


def _shard_seq_len(cfg: PipelineConfig, ctx) -> str:
    """In a run directory with a shard set, plan the sequence length train will use: the shard set's (as
    tasks.runner.shard_set makes every stage that reads it), unless data.seq_len was set explicitly to another.
    Returns the line that says so when the config's (its preset's) data.seq_len is another, else ""."""
    shard = ctx.inputs.get("shard") or {}
    seq = shard.get("seq_len")
    if not seq or seq == cfg.data.seq_len or _arg(ctx, "seq_len"):
        return ""
    if "data.seq_len" in cfg.explicit:
        raise StageError(
            f"data.seq_len: {cfg.data.seq_len} differs from the shard set's {seq}; leave it unset to use the shard "
            "set's, or plan another length with --seq-len"
        )
    own, cfg.data.seq_len = cfg.data.seq_len, seq
    where = f" ({shard['shard_dir']})" if shard.get("shard_dir") else ""
    return (
        f"seq {seq} is this run directory's shard set's{where}, not the config's data.seq_len {own}: training here "
        f"takes the shard set's; --seq-len {own} plans the config's, a shard set built with it trains it"
    )


def _seq_len_warning(pb) -> str:
    """A planned sequence longer than the model's context (max_seq_len, its RoPE table): the plan sizes it (memory
    and step time do not depend on the table), but training refuses it (tasks.model.resolve.seq_len_problem); said
    as training says it, naming the setting that lets it train, else ""."""
    from tasks.model.resolve import seq_len_problem

    problem = seq_len_problem(pb.seq_len, pb.shape) if getattr(pb, "shape", None) is not None else ""
    return f"training would refuse this length: {problem}" if problem else ""


def _model_sets_unused(cfg: PipelineConfig, ctx) -> None:
    """A what-if model (--model, --hf-config, --params, shape flags) replaces the config's: a model.* value that
    names or shapes the config's model (model.preset, model.hf_path, a shape override) set explicitly for this run
    would be dropped without a word, so it is refused in one line."""
    from tasks.config import SHAPE_OVERRIDES

    flags = [f"--{f.replace('_', '-')}" for f in _MODEL_FLAGS if _arg(ctx, f) is not None]
    dropped = sorted(
        k
        for k in cfg.explicit
        if k.partition(".")[0] == "model" and k.partition(".")[2] in (*SHAPE_OVERRIDES, "preset", "hf_path")
    )
    if flags and dropped:
        raise StageError(
            f"{', '.join(dropped)}: set for the config's model, which {'/'.join(flags)} replaces in this plan; "
            "give the shape as flags (--layers, --hidden, --heads, --kv-heads, --ffn, --vocab), or drop the flag"
        )


def run(cfg: PipelineConfig, ctx) -> dict:
    _model_sets_unused(cfg, ctx)
    seq_note = _shard_seq_len(cfg, ctx)
    moe = _moe_model(cfg, ctx)
    pinned = False
    if moe is not None:
        pb, model_desc, doc, table, result = _moe_plan(cfg, ctx, *moe)
        ranked = result
    else:
        if cfg.parallel.ep > 1 and not any(_arg(ctx, f) is not None for f in _MODEL_FLAGS):  # train would refuse it
            raise StageError(
                f"parallel.ep: {cfg.parallel.ep} needs a mixture-of-experts model (e.g. model.preset moe-demo); set "
                "parallel.ep 1"
            )
        pb, model_desc, pinned = problem(cfg, ctx)
        result = search(pb)
        # A pinned layout is only verified; the table (and train's out-of-memory advice) still ranks the alternatives.
        ranked = search(problem(cfg, ctx, config_pins=False)[0]) if pinned else result
        header = (
            f"model: {model_desc}\ncluster: {pb.cluster.describe()}, reserve {pb.cluster.reserve_gb:g} GB\n"
            f"training: seq {pb.seq_len}, global batch {pb.global_batch}, {pb.precision}, {pb.optimizer}"
            f"{', pinned ' + str(pb.pins) if pb.pins else ''}{_training_source(ctx)}"
        )
        table = render(ranked, header, top_k=cfg.plan.top_k, pinned=result if pinned else None)
        doc = {
            "model": model_desc,
            "cluster": dataclasses.asdict(pb.cluster),
            "seq_len": pb.seq_len,
            "global_batch": pb.global_batch,
            "precision": pb.precision,
            "optimizer": pb.optimizer,
            "pins": pb.pins,
            "pinned": pinned,
            "chosen": (result["plans"] or result["rejected"] or [None])[0],
            **ranked,
        }
    c = pb.cluster
    out = ctx.run_dir / "plan"  # <run-dir>/plan.json is the runner's result file: keep ours beside it
    plan_path = atomic_write_json(out / "plan.json", doc)
    table_path = atomic_write_text(out / "plan_table.txt", table + "\n")
    tracking.log_artifact(plan_path)
    tracking.log_artifact(table_path)
    chosen, status = _choose(result, pinned, pb, model_desc, plan_path)
    extra = ("all_to_all_bytes", "all_to_all_share") if moe is not None else ("bubble",)
    planned = (*_PARALLEL, "ep") if moe is not None else _PARALLEL  # ep: MoE only

    tracking.log_params({f"plan.{k}": chosen[k] for k in (*planned, "pp_schedule")})
    tracking.log_metrics(
        {
            "plan.total_gb": chosen["total_bytes"] / GB,
            "plan.step_s": chosen["step_s"],
            "plan.tokens_per_s": chosen["tokens_per_s"],
            "plan.feasible": len(ranked["plans"]),
            "plan.rejected": len(ranked["rejected"]),
            **({"plan.all_to_all_share": chosen["all_to_all_share"]} if moe is not None else {}),
        }
    )
    parallel = {k: chosen[k] for k in planned}
    # without PP the config's schedule, unless it is interleaved 1F1B, which training refuses below pp 2 (an
    # explicit one rules pp 1 out in the search)
    own = cfg.parallel.pp_schedule
    parallel["pp_schedule"] = (
        chosen["pp_schedule"] if chosen["pp"] > 1 else ("1f1b" if own == "interleaved1f1b" else own)
    )
    parallel["virtual_stages"] = chosen["virtual_stages"] if chosen["pp_schedule"] == "interleaved1f1b" else 1
    parallel["sequence_parallel"] = chosen["sequence_parallel"]
    ep = f"·ep{chosen['ep']}" if moe is not None else ""
    a2a = f" ({chosen['all_to_all_share']:.0%} all-to-all)" if moe is not None else ""
    layout = (
        f"dp{chosen['dp']}{ep} tp{chosen['tp']} pp{chosen['pp']} zero{chosen['zero']} {chosen['recompute']} "
        f"mb{chosen['micro_batch']}×{chosen['microbatches']}"
    )
    summary = (
        f"{'pinned ' if pinned else ''}{layout}: {chosen['total_bytes'] / GB:.2f} GB of {c.memory_gb:g} GB"
        f"/device, est. step {chosen['step_s']:.3g} s{a2a} ({len(ranked['plans'])} feasible, "
        f"{len(ranked['rejected'])} rejected)"
    )
    if status == "warn":
        summary = f"pinned {layout} {chosen['reason']} (estimate); training may run out of memory"
    if seq_note:
        summary = f"{summary}; {seq_note}"
    for warning in (_seq_len_warning(pb), _hf_config_warning(ctx)):
        if warning:
            status, summary = "warn", f"{summary}; {warning}"
    device = cfg.hardware.device
    if device in ("npu", "cuda") and c.kind != device and not _arg(ctx, "cluster"):
        status, summary = (
            "warn",
            (
                f"hardware.device is {device} but hardware.cluster {c.name} describes {c.kind} "
                f"devices: set hardware.cluster; {summary}"
            ),
        )
    if not getattr(ctx.args, "json", False):  # --json keeps stdout machine-readable
        print(table)
    return {
        "status": status,
        "summary": summary,
        "plan_json": str(plan_path),
        "table": str(table_path),
        "parallel": parallel,
        "pinned": pinned,
        "feasible": len(ranked["plans"]),
        "rejected": len(ranked["rejected"]),
        "best": {k: chosen[k] for k in (*_BEST, *extra)},
    }
