"""Model-family rules for a custom architecture given only by its main numbers (`python -m tasks plan --hidden …
--layers … --heads …`): the fields left out come from a named rule, never from whatever preset the config holds.

- llama3 (Meta's reference `llama/model.py`, FeedForward): ffn = multiple_of · ⌈int(ffn_dim_multiplier · int(2 · 4h
  / 3)) / multiple_of⌉ with ffn_dim_multiplier 1.3 and multiple_of 1024 — Llama-3-8B 4096 → 14336, Llama-3-70B
  8192 → 28672 (the published sizes); 8 KV heads (grouped-query attention in every Llama 3 model); the 128,256-token
  tiktoken vocabulary; untied output layer.
- llama2: the same code with ffn_dim_multiplier None and multiple_of 256 — Llama-2-7B 4096 → 11008, Llama-2-13B
  5120 → 13824; multi-head attention (KV heads = heads, as 7B and 13B); the 32,000-token SentencePiece vocabulary.
- qwen2: Qwen2 publishes `intermediate_size` per model (0.5B 4864 = 5.43h, 1.5B 8960 = 5.83h, 7B 18944 = 5.29h,
  72B 29568 = 3.61h) and no rule that gives it from the hidden size, so a custom Qwen2 needs --ffn (and
  --kv-heads); vocabulary 151,936 (the 0.5B/1.5B configs), q/k/v bias, untied output layer (as 7B/72B).
"""

from __future__ import annotations

from tasks.errors import ConfigError

FAMILIES = ("llama3", "llama2", "qwen2")


def llama_ffn(hidden: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """FeedForward.__init__ of Meta's llama/model.py: hidden_dim = 4·dim, then 2/3 of it, × the multiplier,
    rounded up to a multiple of multiple_of."""
    ffn = int(2 * (4 * hidden) / 3)
    if ffn_dim_multiplier is not None:
        ffn = int(ffn_dim_multiplier * ffn)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


def custom_fields(family: str, hidden: int, heads: int, given: dict) -> tuple[dict, str]:
    """The TransformerConfig fields of a custom `family` model that `given` (explicit flags) leaves out, and a
    one-phrase description of the rule used. Raises ConfigError (one line) when the family has no rule for one."""
    if family not in FAMILIES:
        raise ConfigError(f"--family: {family!r} is not one of {', '.join(FAMILIES)}")
    derived: dict = {}
    if family == "llama3":
        derived = dict(
            family="llama",
            n_kv_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
            norm_eps=1e-5,
            max_seq_len=8192,
            ffn_dim=llama_ffn(hidden, 1024, 1.3),
        )
        rule = "llama3 rule: ffn 1024⌈1.3·⌊8h/3⌋/1024⌉, 8 KV heads, vocab 128256"
        if "n_kv_heads" not in given and heads % 8:
            raise ConfigError(f"--heads {heads}: the llama3 rule's 8 KV heads do not divide it; pass --kv-heads")
    elif family == "llama2":
        derived = dict(
            family="llama",
            n_kv_heads=heads,
            vocab_size=32000,
            rope_theta=10000.0,
            norm_eps=1e-5,
            max_seq_len=4096,
            ffn_dim=llama_ffn(hidden, 256),
        )
        rule = "llama2 rule: ffn 256⌈⌊8h/3⌋/256⌉, KV heads = heads, vocab 32000"
    else:
        missing = [flag for flag, key in (("--ffn", "ffn_dim"), ("--kv-heads", "n_kv_heads")) if key not in given]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)}: a custom qwen2 model needs them (Qwen2 publishes "
                "intermediate_size and KV heads per model, no rule from the hidden size)"
            )
        derived = dict(
            family="qwen2", vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=32768, qkv_bias=True
        )
        rule = "qwen2: vocab 151936, q/k/v bias"
    return {k: v for k, v in derived.items() if k not in given}, rule
