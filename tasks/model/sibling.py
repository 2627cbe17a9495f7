"""The model the smoke stage trains (`smoke.model`): the configured one when it fits one device, else a small sibling.

The field guides' first rule is to make the whole flow work on a model of at most ~1B parameters, FP32 then mixed
precision, before the expensive run. Smoke is single-device, and FP32 AdamW holds 16 bytes per parameter, so no
real-size model (7B and up) fits one 64 GB card. `auto` keeps what smoke is for — the same code, data and numerics —
on a model that fits:

- the configured model itself when the planner's single-device estimate (FP32 AdamW, `smoke.micro_batch`, the shard
  set's sequence length) plus the runtime reserve fits one device of `hardware.cluster` with `smoke.memory_margin`
  of its memory to spare, and it has at most `smoke.max_params` parameters;
- else a sibling: the same family and block structure (RMSNorm eps, RoPE theta and head size, q/k/v bias, the GQA
  ratio, tied or untied output, for MoE the same router: top-k, renormalisation, aux-loss weight, capacity factor
  and shared expert, with fewer experts), the shard set's vocabulary, and depth and width halved in turn — depth
  while it is at least the KV-head count, else width, keeping the head size — until it fits.

Nothing here builds a model or imports torch: candidates are TransformerConfigs sized by tasks.planner's estimate.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable

from tasks.errors import ConfigError
from tasks.model.config import PRESETS, TransformerConfig, num_params
from tasks.units import GB

AUTO, SAME = "auto", "same"
MIN_LAYERS = 2  # below two blocks a smoke run no longer exercises what passes between layers
# Published checkpoints pad the tokenizer's vocabulary to a round number of embedding rows (Qwen2's tokenizer: 151646
# tokens, 151936 rows in 0.5B/1.5B/57B-A14B, 152064 in 7B; Megatron pads to a multiple of 128 × TP): a preset within
# this many rows above the shard set's tokenizer is taken as that tokenizer's model.
VOCAB_PADDING = 1024
SIBLING_EXPERTS = 4  # a MoE sibling keeps max(2 · top_k, this) experts (at most the model's own)


@dataclasses.dataclass(frozen=True)
class Budget:
    """One device as smoke sees it: memory, the runtime's reserve, the margin kept free, and the parameter cap."""

    device_bytes: float
    reserve_bytes: float
    margin: float
    max_params: float

    @property
    def usable_bytes(self) -> float:
        return self.device_bytes * (1.0 - self.margin) - self.reserve_bytes

    def describe(self) -> str:
        return (
            f"{self.usable_bytes / GB:.2f} GB usable ({self.device_bytes / GB:g} GB device × (1 − smoke.memory_margin "
            f"{self.margin:g}) − {self.reserve_bytes / GB:g} GB runtime reserve)"
        )


def record(tcfg: TransformerConfig, derived_from: str, why: str, estimate_bytes: float | None = None) -> dict:
    """smoke.json's / MLflow's `smoke_model`."""
    out = {
        "derived_from": derived_from,
        "family": tcfg.family,
        "params": num_params(tcfg),
        "layers": tcfg.n_layers,
        "hidden": tcfg.dim,
        "heads": tcfg.n_heads,
        "kv_heads": tcfg.n_kv_heads,
        "experts": tcfg.n_experts,
        "vocab": tcfg.vocab_size,
        "why": why,
    }
    if estimate_bytes is not None:
        out["estimate_bytes"] = int(estimate_bytes)
    return out


def _round(x: float, multiple: int = 8) -> int:
    return max(multiple, multiple * round(x / multiple))


def scaled(tcfg: TransformerConfig, vocab: int, layers: int, kv_heads: int, experts: int) -> TransformerConfig:
    """`tcfg` with `layers` blocks, `kv_heads` KV heads (query heads by the same GQA ratio, head size kept, MLP widths
    scaled with the hidden size), `experts` routed experts and the vocabulary `vocab`; everything else kept."""
    ratio = tcfg.n_heads // tcfg.n_kv_heads
    heads = kv_heads * ratio
    dim = heads * tcfg.head_dim
    width = dim / tcfg.dim
    moe = {}
    if tcfg.n_experts:
        moe = dict(
            n_experts=experts,
            top_k=min(tcfg.top_k, experts),
            moe_ffn_dim=_round(tcfg.moe_ffn_dim * width),
            shared_ffn_dim=_round(tcfg.shared_ffn_dim * width) if tcfg.shared_ffn_dim else 0,
            mlp_only_layers=[i for i in tcfg.mlp_only_layers if i < layers],
        )
    return dataclasses.replace(
        tcfg,
        vocab_size=vocab,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        dim=dim,
        ffn_dim=_round(tcfg.ffn_dim * width),
        **moe,
    ).validate()


def candidates(tcfg: TransformerConfig, vocab: int):
    """Siblings from the largest to the smallest: depth halved while it is at least the KV-head count, else width
    (KV heads halved, query heads by the GQA ratio), down to MIN_LAYERS blocks and one KV head."""
    floor = max(MIN_LAYERS, tcfg.decoder_sparse_step if tcfg.n_experts else 1)  # a MoE sibling keeps a sparse layer
    layers, kv = tcfg.n_layers, tcfg.n_kv_heads
    experts = min(tcfg.n_experts, max(2 * tcfg.top_k, SIBLING_EXPERTS)) if tcfg.n_experts else 0
    while True:
        yield scaled(tcfg, vocab, layers, kv, experts)
        if layers // 2 >= floor and (kv == 1 or layers // 2 >= kv):
            layers //= 2
        elif kv > 1:
            kv //= 2
        elif layers > floor:
            layers = floor
        else:
            return


def derive(
    tcfg: TransformerConfig,
    name: str,
    vocab: int,
    estimate: Callable[[TransformerConfig], float],
    budget: Budget,
) -> tuple[TransformerConfig, dict]:
    """`smoke.model=auto`: the configured model when it fits `budget`, else the largest candidate that does.
    `estimate(tcfg)` is one device's peak bytes (FP32 AdamW, the smoke micro-batch; without the reserve).
    Raises ConfigError (one line, with the smallest estimate) when even the smallest sibling does not fit."""
    est = estimate(tcfg)
    n = num_params(tcfg)
    if est <= budget.usable_bytes and n <= budget.max_params:
        why = f"the configured model fits: {est / GB:.2f} GB FP32 AdamW estimate of {budget.describe()}"
        return tcfg, record(tcfg, name, why, est)
    over = (
        f"{est / GB:.1f} GB FP32 AdamW estimate > {budget.describe()}"
        if est > budget.usable_bytes
        else f"{n / 1e9:.2f}B params > smoke.max_params {budget.max_params:.3g}"
    )
    tried = 0
    for sib in candidates(tcfg, vocab):
        tried += 1
        est_s, n_s = estimate(sib), num_params(sib)
        if est_s <= budget.usable_bytes and n_s <= budget.max_params:
            why = (
                f"{name} does not fit one device ({over}); sibling: {sib.n_layers}/{tcfg.n_layers} layers, hidden "
                f"{sib.dim}/{tcfg.dim}, {sib.n_heads}/{sib.n_kv_heads} heads"
                + (f", {sib.n_experts}/{tcfg.n_experts} experts" if tcfg.n_experts else "")
                + f", vocab {vocab}: {est_s / GB:.2f} GB estimate ({tried} candidates tried)"
            )
            return sib, record(sib, name, why, est_s)
    if est_s <= budget.usable_bytes:  # it fits the memory: the parameter cap is what no sibling passes
        raise ConfigError(
            f"smoke.model=auto: no sibling of {name} is under smoke.max_params {budget.max_params:.3g}: the smallest "
            f"({sib.n_layers} layers, hidden {sib.dim}) has {n_s / 1e6:.2f}M params; raise smoke.max_params, or set "
            "smoke.model=same"
        )
    raise ConfigError(
        f"smoke.model=auto: no sibling of {name} fits one device: the smallest ({sib.n_layers} layers, hidden "
        f"{sib.dim}, {n_s / 1e6:.1f}M params) needs {est_s / GB:.2f} GB (FP32 AdamW) against {budget.describe()}; "
        f"lower smoke.micro_batch or data.seq_len, or give a larger hardware.device_memory_gb"
    )


def named(tcfg: TransformerConfig, name: str, preset: str, vocab: int) -> tuple[TransformerConfig, dict]:
    """`smoke.model=<preset>`: that preset, refused in one line when it is unknown, of another family, or built for
    another vocabulary than the shard set's tokenizer (its embedding rows would be another tokenizer's)."""
    if preset not in PRESETS:
        raise ConfigError(f"smoke.model: unknown preset {preset!r} (auto, same, or one of: {', '.join(PRESETS)})")
    sib = TransformerConfig.from_preset(preset, tokenizer_vocab=vocab)  # a CPU-sized preset: the shard set's vocab
    if sib.family != tcfg.family:
        raise ConfigError(
            f"smoke.model: preset {preset!r} is family {sib.family}, the configured model {name} is {tcfg.family}: "
            f"a smoke model must share the family (or use smoke.model=auto)"
        )
    if not (vocab <= sib.vocab_size <= vocab + VOCAB_PADDING or sib.vocab_size == tcfg.vocab_size >= vocab):
        raise ConfigError(
            f"smoke.model: preset {preset!r} has a {sib.vocab_size}-row embedding, the shard set's tokenizer "
            f"{vocab} tokens: it is another tokenizer's vocabulary (use smoke.model=auto, which takes the shard "
            f"set's)"
        )
    sib.max_seq_len = max(sib.max_seq_len, tcfg.max_seq_len)
    return sib.validate(), record(sib, name, f"smoke.model={preset}")


def budget_of(cfg) -> Budget:
    """One device of the configured cluster (hardware.device_memory_gb when set: on a CPU host it stands for the
    device), its runtime reserve (plan.runtime_reserve_gb when set), smoke.memory_margin and smoke.max_params."""
    from tasks.planner.cluster import get_cluster

    c = get_cluster(
        cfg.hardware.cluster, memory_gb=cfg.hardware.device_memory_gb, reserve_gb=cfg.plan.runtime_reserve_gb
    )
    return Budget(c.memory_gb * GB, c.reserve_gb * GB, cfg.smoke.memory_margin, cfg.smoke.max_params)


def estimator(cfg, seq_len: int) -> Callable[[TransformerConfig], float]:
    """The planner's single-device peak for a smoke run: FP32, AdamW, no parallelism, `smoke.micro_batch` sequences
    of `seq_len` tokens, fused attention where the cluster's devices have it."""
    from tasks.device import fused_attention_available
    from tasks.planner import estimate_for_run

    flash = fused_attention_available(cfg.hardware.cluster)

    def estimate(t: TransformerConfig) -> float:
        kw = {} if t.n_experts else {"flash_attention": flash}
        return float(estimate_for_run(t, seq_len, cfg.smoke.micro_batch, precision="fp32", **kw))

    return estimate


def choose(cfg, tcfg: TransformerConfig, vocab: int, seq_len: int) -> tuple[TransformerConfig, dict]:
    """The smoke model for `smoke.model` (auto | same | a preset) and its `smoke_model` record."""
    name = cfg.model.hf_path or cfg.model.preset
    choice = cfg.smoke.model.strip()
    if choice == AUTO:
        return derive(tcfg, name, vocab, estimator(cfg, seq_len), budget_of(cfg))
    if choice == SAME:
        chosen, info = tcfg, record(tcfg, name, "smoke.model=same: the configured model")
    else:
        chosen, info = named(tcfg, name, choice, vocab)
    # A model the user names is trained as named; one the estimate says cannot fit is said before it is built (the
    # process is otherwise killed for memory with no line of its own; auto would have derived a sibling that fits)
    est, budget = estimator(cfg, seq_len)(chosen), budget_of(cfg)
    info["estimate_bytes"] = int(est)
    if est > budget.usable_bytes:
        print(
            f"warning: smoke.model={choice}: {est / GB:.1f} GB FP32 AdamW estimate > {budget.describe()}: it may be "
            "killed for memory; smoke.model=auto derives a sibling that fits",
            file=sys.stderr,
            flush=True,
        )
    return chosen, info


def ln_vocab(tcfg: TransformerConfig) -> float:
    """The loss of a uniform guess over the model's vocabulary."""
    return math.log(tcfg.vocab_size)
