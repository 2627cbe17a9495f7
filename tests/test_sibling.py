"""smoke.model: the configured model when it fits one device, else a sibling of the same structure that does
(tasks/model/sibling.py); one-line refusals for a bad smoke.model. Pure: TransformerConfigs and the planner's
estimate."""

from __future__ import annotations

import dataclasses

import pytest

from tasks.config import load_config
from tasks.errors import ConfigError
from tasks.model import num_params
from tasks.model.config import get_preset
from tasks.model.sibling import budget_of, candidates, choose, estimator
from tasks.units import GB

SEQ = 128


def _cfg(preset: str, **sets):
    sets = {"model.preset": preset, **sets}
    return load_config("demo-cpu", sets=[f"{k}={v}" for k, v in sets.items()])


def _structure(t):
    return (
        t.family,
        t.n_heads // t.n_kv_heads,
        t.head_dim,
        t.rope_theta,
        t.norm_eps,
        t.qkv_bias,
        t.tie_embeddings,
        t.max_seq_len,
    )


def test_auto_keeps_the_configured_model_when_it_fits():
    cfg = _cfg("demo")
    full = dataclasses.replace(get_preset("demo"), vocab_size=2048)
    tcfg, info = choose(cfg, full, 2048, SEQ)
    assert tcfg is full
    assert info["derived_from"] == "demo" and info["layers"] == 4 and info["hidden"] == 128
    assert info["why"].startswith("the configured model fits")
    # The same model one byte of budget short: a sibling instead.
    cfg.hardware.device_memory_gb = (info["estimate_bytes"] + 0.12 * GB) / 0.75 / GB * 0.999
    tcfg, info = choose(cfg, full, 2048, SEQ)
    assert tcfg is not full and info["params"] < num_params(full)


@pytest.mark.parametrize(
    "preset, cluster, memory_gb, vocab",
    [
        ("llama3-8b", "cpu-laptop", 2, 2048),  # the new user's try: a demo shard set, a 2 GB "device"
        ("llama3-70b", "910c", 0, 128256),
        ("qwen2-7b", "910b", 0, 151646),
        ("qwen2-0.5b", "cpu-laptop", 1, 2048),  # tied embeddings
        ("qwen2-57b-a14b", "910b", 0, 151646),  # MoE
        ("llama-13b", "cpu-laptop", 0.5, 2048),  # multi-head attention (no GQA)
    ],
)
def test_auto_sibling_keeps_the_structure_and_is_the_largest_that_fits(preset, cluster, memory_gb, vocab):
    cfg = _cfg(preset, **{"hardware.cluster": cluster, "hardware.device_memory_gb": memory_gb})
    full = get_preset(preset)
    sib, info = choose(cfg, full, vocab, SEQ)
    budget, estimate = budget_of(cfg), estimator(cfg, SEQ)
    assert _structure(sib) == _structure(full) and sib.vocab_size == vocab
    assert estimate(sib) <= budget.usable_bytes and num_params(sib) <= cfg.smoke.max_params
    assert sib.n_layers >= 2 and sib.n_layers < full.n_layers or sib.dim < full.dim
    assert info == {
        "derived_from": preset,
        "family": full.family,
        "params": num_params(sib),
        "layers": sib.n_layers,
        "hidden": sib.dim,
        "heads": sib.n_heads,
        "kv_heads": sib.n_kv_heads,
        "experts": sib.n_experts,
        "vocab": vocab,
        "why": info["why"],
        "estimate_bytes": int(estimate(sib)),
    }
    assert f"{preset} does not fit one device" in info["why"]
    # The largest that fits: every larger candidate does not.
    larger = []
    for c in candidates(full, vocab):
        if c == sib:
            break
        larger.append(c)
    assert all(estimate(c) > budget.usable_bytes or num_params(c) > cfg.smoke.max_params for c in larger)
    if full.n_experts:  # fewer experts, the same router
        assert sib.n_experts < full.n_experts and sib.top_k == full.top_k
        assert (sib.norm_topk_prob, sib.aux_loss_coef, sib.capacity_factor, sib.decoder_sparse_step) == (
            full.norm_topk_prob,
            full.aux_loss_coef,
            full.capacity_factor,
            full.decoder_sparse_step,
        )
        assert (sib.shared_ffn_dim > 0) == (full.shared_ffn_dim > 0) and sib.n_moe_layers >= 1


def test_max_params_caps_the_sibling():
    cfg = _cfg("llama3-8b", **{"hardware.cluster": "910b", "smoke.max_params": 2e8})
    sib, info = choose(cfg, get_preset("llama3-8b"), 128256, SEQ)
    assert info["params"] <= 2e8 < num_params(get_preset("llama3-8b"))


def test_same_and_a_named_preset():
    full = get_preset("llama3-8b")
    tcfg, info = choose(_cfg("llama3-8b", **{"smoke.model": "same"}), full, 2048, SEQ)
    assert tcfg is full and info["why"] == "smoke.model=same: the configured model"
    # A small preset of the same family takes the shard set's vocabulary.
    tcfg, info = choose(_cfg("llama3-8b", **{"smoke.model": "debug"}), full, 2048, SEQ)
    assert (tcfg.n_layers, tcfg.vocab_size, info["why"]) == (2, 2048, "smoke.model=debug")
    # A published preset of the same tokenizer (Qwen2's 151646 tokens; 0.5B pads to 151936 rows, 7B to 152064).
    tcfg, _ = choose(_cfg("qwen2-7b", **{"smoke.model": "qwen2-0.5b"}), get_preset("qwen2-7b"), 151646, SEQ)
    assert tcfg.vocab_size == 151936


def test_bad_smoke_model_fails_in_one_line():
    full = get_preset("llama3-8b")
    cases = [
        ({"smoke.model": "llama9"}, 2048, "smoke.model: unknown preset 'llama9' (auto, same, or one of: debug"),
        ({"smoke.model": "qwen2-0.5b"}, 2048, "smoke.model: preset 'qwen2-0.5b' is family qwen2, the configured"),
        ({"smoke.model": "llama-13b"}, 128256, "smoke.model: preset 'llama-13b' has a 32000-row embedding, the "),
        (
            {"hardware.device_memory_gb": 0.3},
            2048,
            "smoke.model=auto: no sibling of llama3-8b fits one device: the smallest (2 layers, hidden 512, 8.9M "
            "params) needs 0.20 GB (FP32 AdamW) against 0.10 GB usable",
        ),
    ]
    for sets, vocab, message in cases:
        with pytest.raises(ConfigError) as e:
            choose(_cfg("llama3-8b", **sets), full, vocab, SEQ)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
