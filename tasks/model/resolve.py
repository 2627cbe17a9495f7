"""The model of a pipeline run: `model.*` resolved to the one shape type (tasks.shape.TransformerConfig)."""

from __future__ import annotations

from tasks.config import SHAPE_OVERRIDES, repo_path
from tasks.errors import ConfigError
from tasks.model.hf_config import read_hf_config
from tasks.shape import TransformerConfig


# model.* overrides a checkpoint's weights do not fix: honoured over its config.json with a warning. Every other
# override (tasks.config.SHAPE_OVERRIDES, a new one too) changes a weight's shape there: refused, never applied.
NOT_IN_WEIGHTS = ("rope_theta", "max_seq_len", "top_k", "aux_loss_coef", "capacity_factor")
WEIGHT_SHAPE = tuple(k for k in SHAPE_OVERRIDES if k not in NOT_IN_WEIGHTS)
# model.* overrides only a mixture-of-experts model reads (model.n_experts on a dense preset fails in validate())
MOE_ONLY = ("top_k", "moe_ffn_dim", "shared_ffn_dim", "aux_loss_coef", "capacity_factor")


def from_pipeline(
    cfg, vocab_size: int | None = None, check_seq_len: bool = True, vocab_from: str = ""
) -> TransformerConfig:
    """The model of a PipelineConfig: `TransformerConfig.from_preset(model.preset, **overrides)`, or
    `from_hf_config(model.hf_path, **overrides)`, checked against the shard set.

    `vocab_size` is the tokenizer's size: it fills the embedding of a preset without a vocabulary of its own (debug,
    demo, moe-demo) and must fit in any model; `vocab_from` says where that size comes from when it is not a shard
    set's tokenizer (a plan without one: "data.vocab_size (…)"). `check_seq_len` False: data.seq_len may exceed the
    model's max_seq_len (the planner sizes any length, and says what training would refuse: seq_len_problem).
    """
    mc = cfg.model
    if mc.hf_path:
        published = read_hf_config(repo_path(mc.hf_path))  # validated: a bad file named as the file, not model.*
        tcfg = published.override(**mc.overrides())
        shaped = [k for k in WEIGHT_SHAPE if getattr(tcfg, k) != getattr(published, k)]
        if shaped:  # its weights cannot load into another shape (fewer layers would load, the rest dropped)
            raise ConfigError(
                [
                    f"model.{k}: {getattr(tcfg, k)} differs from {getattr(published, k)} in model.hf_path's "
                    f"config.json, whose weights the model starts from; unset model.{k}"
                    for k in shaped
                ]
            )
        _say_overrides(mc.hf_path, published, tcfg)
        if "model.preset" in cfg.explicit and ("preset", mc.hf_path, mc.preset) not in _SAID:
            from tasks.logs import log

            _SAID.add(("preset", mc.hf_path, mc.preset))
            log.warning(
                f"model.preset {mc.preset} is not used: the model is model.hf_path's ({mc.hf_path}, its config.json "
                "gives the shape); unset one of them"
            )
    else:
        tcfg = TransformerConfig.from_preset(mc.preset, tokenizer_vocab=vocab_size, **mc.overrides())
    moe_only = [k for k in MOE_ONLY if k in mc.overrides()]
    if moe_only and not tcfg.n_experts:  # a dense model has no router or experts: never a silently ignored value
        model = f"model.hf_path {mc.hf_path}" if mc.hf_path else f"model.preset {mc.preset}"
        raise ConfigError(
            f"model.{', model.'.join(moe_only)}: mixture-of-experts settings, but {model} is dense (no experts); "
            "unset them or choose a MoE model (model.preset moe-demo)"
        )
    tcfg.validate()
    if vocab_size and vocab_size > tcfg.vocab_size and mc.hf_path:
        # a shard set's tokenizer may be the checkpoint's own (then the checkpoint disagrees with itself)
        which = vocab_from or "the shard set's tokenizer"
        same = (
            ""
            if vocab_from
            else " — if that is the one, the checkpoint's tokenizer and its config.json's vocab_size disagree: fix "
            "the checkpoint"
        )
        raise ConfigError(
            f"model.hf_path: {which} has {vocab_size} tokens but the checkpoint's embedding only {tcfg.vocab_size}; "
            f"shard with the checkpoint's own tokenizer (data.tokenizer={mc.hf_path}){same}"
        )
    if vocab_size and vocab_size > tcfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {vocab_from or 'tokenizer'} has {vocab_size} tokens but the model embedding only "
            f"{tcfg.vocab_size}; set model.vocab_size >= {vocab_size} (or leave it unset on a CPU-sized preset)"
        )
    problem = seq_len_problem(cfg.data.seq_len, tcfg)
    if problem and check_seq_len:
        raise ConfigError(problem)
    return tcfg


def seq_len_problem(seq_len: int, tcfg: TransformerConfig) -> str:
    """Training's refusal of sequences longer than the model's context (its RoPE table), else ""."""
    if seq_len <= tcfg.max_seq_len:
        return ""
    return (
        f"data.seq_len: {seq_len} exceeds model max_seq_len {tcfg.max_seq_len}; set data.seq_len <= "
        f"{tcfg.max_seq_len} (the context the model was made for), or model.max_seq_len >= {seq_len}"
    )


_SAID: set = set()


def _say_overrides(path, published: TransformerConfig, tcfg: TransformerConfig) -> None:
    """A model.* value set over a checkpoint's own config.json changes the published model (its RoPE, its context):
    honoured, and said once per process — training, the export and everything after use the set value."""
    changed = [
        f"model.{k} {getattr(tcfg, k)!r} (its config.json: {getattr(published, k)!r})"
        for k in published.__dataclass_fields__
        if getattr(tcfg, k) != getattr(published, k)
    ]
    if changed and (str(path), tuple(changed)) not in _SAID:
        from tasks.logs import log

        _SAID.add((str(path), tuple(changed)))
        log.warning(f"model.hf_path {path}: {'; '.join(changed)} — set over the checkpoint; trained and exported so")
