"""config.json settings transformers loads as the function this model computes are accepted, not refused: a Qwen2
`use_sliding_window` no layer takes up, `hidden_act: "swish"` (ACT2FN's nn.SiLU), a Qwen2 `mlp_bias` (its MLP is
bias-free whatever the key says). Each: a tiny model built and saved by transformers, loaded by ours, weights and
logits equal to transformers' own load of the same directory; a layer that does slide is still refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.errors import StageError
from tasks.model.hf_config import ours_to_hf
from tasks.model.hf_io import load_hf
from tasks.shape import TransformerConfig
from tests.helpers.models import LLAMA_CONFIG, tiny_qwen2

TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))  # 16 > the window of 4 below

QWEN2_CASES = {
    # layers below max_window_layers attend fully (Qwen2Config): with 2 layers and max_window_layers 2, none slides
    "use_sliding_window-no-layer-slides": dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
    "hidden_act-swish": dict(hidden_act="swish"),
    "mlp_bias": dict(mlp_bias=True),
}


def _assert_loads_as_transformers(path):
    """Ours and transformers' from_pretrained of `path`: every weight equal, logits within 1e-4 (fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_hf(path).eval()
    theirs = hf.state_dict()
    for name, t in ours.state_dict().items():
        if "experts" not in name:  # stacked per-expert tensors: compared through the logits
            assert t.equal(theirs[ours_to_hf(name)]), name
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=1e-4)
    return hf


@pytest.mark.parametrize("case", list(QWEN2_CASES))
def test_a_qwen2_setting_transformers_computes_as_ours_loads_with_its_logits(case, tmp_path):
    tiny_qwen2(tmp_path / "hf", vocab=96, **QWEN2_CASES[case])
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert all(written[k] == v for k, v in QWEN2_CASES[case].items())  # the setting is in the file as given
    hf = _assert_loads_as_transformers(tmp_path / "hf")
    if case == "hidden_act-swish":
        assert type(hf.model.layers[0].mlp.act_fn) is torch.nn.SiLU
    if case == "mlp_bias":
        assert hf.model.layers[0].mlp.up_proj.bias is None  # transformers' Qwen2 does not read it
    if case.startswith("use_sliding_window"):
        assert hf.config.sliding_window == 4 and set(hf.config.layer_types) == {"full_attention"}
        # a config.json of transformers 4 (no layer_types): both derive the layer types from max_window_layers
        del written["layer_types"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(written))
        _assert_loads_as_transformers(tmp_path / "hf")


def test_a_qwen2_moe_with_the_three_settings_loads_with_transformers_logits(tmp_path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        use_sliding_window=True,  # Qwen2MoeConfig: odd layers *below* max_window_layers slide; 0: none does
        sliding_window=4,
        max_window_layers=0,
        hidden_act="swish",
        mlp_bias=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits the router and biases: random, so routing and mapping are exercised
        for name, p in model.named_parameters():
            if name.endswith(("bias", "mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    assert set(model.config.layer_types) == {"full_attention"}
    _assert_loads_as_transformers(tmp_path / "hf")


QWEN2 = {**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN2_MOE = {**QWEN2, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4}
WINDOWS = [
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),  # Qwen2: layer 1 slides
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),  # Qwen2: both slide; MoE: none
    dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),  # Qwen2: no window, none slides
    dict(use_sliding_window=True),  # the defaults: max_window_layers 28
    dict(use_sliding_window=False, sliding_window=4, max_window_layers=0),
    dict(use_sliding_window=True, max_window_layers=28, layer_types=["full_attention", "sliding_attention"]),
    dict(use_sliding_window=True, max_window_layers=0, layer_types=["full_attention", "full_attention"]),
]


@pytest.mark.parametrize("family", ["Qwen2", "Qwen2Moe"])
def test_a_window_is_refused_exactly_when_a_transformers_layer_slides(tmp_path, family):
    """Whichever layers transformers' own Config gives a sliding window: accepted when none, one line otherwise."""
    import transformers

    base = QWEN2 if family == "Qwen2" else QWEN2_MOE
    config_cls = getattr(transformers, f"{family}Config")
    for setting in WINDOWS:
        theirs = config_cls(**{k: v for k, v in base.items() if k not in ("architectures", "model_type")}, **setting)
        sliding = [i for i, t in enumerate(theirs.layer_types) if t != "full_attention"]
        (tmp_path / "config.json").write_text(json.dumps({**base, **setting}))
        if not sliding:
            assert TransformerConfig.from_hf_config(tmp_path).n_layers == 2, setting
            continue
        with pytest.raises(StageError) as e:
            TransformerConfig.from_hf_config(tmp_path)
        said = str(e.value)
        assert "\n" not in said and "use a checkpoint without it" in said, said
        named = ", ".join(f"{i} sliding_attention" for i in sliding)
        assert f"unsupported setting use_sliding_window (layers not full attention: {named})" in said, (setting, said)


@pytest.mark.parametrize(
    "base, setting, said",
    [
        (QWEN2, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (QWEN2, {"hidden_act": "SiLU"}, "hidden_act 'SiLU'"),  # not an ACT2FN key: transformers fails on it too
        (QWEN2, {"layer_types": ["full_attention"]}, "not one type per layer"),
        (LLAMA_CONFIG, {"mlp_bias": True}, "mlp_bias"),  # LlamaMLP reads it: a bias this model has not
        (LLAMA_CONFIG, {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_what_transformers_computes_otherwise_is_still_refused(tmp_path, base, setting, said):
    (tmp_path / "config.json").write_text(json.dumps({**base, **setting}))
    with pytest.raises(StageError) as e:
        TransformerConfig.from_hf_config(tmp_path)
    assert said in str(e.value) and "unsupported setting" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Qwen2Moe"])
def test_a_config_without_max_position_embeddings_reads_as_transformers_reads_it(family):
    """A hand-written config.json may leave max_position_embeddings out: its length is its Config class's default
    (LlamaConfig 2048, Qwen2's 32768), as transformers loads it — not Llama's 2048 for every family."""
    import transformers

    from tasks.shape import config_from_hf

    theirs = getattr(transformers, f"{family}Config")(num_hidden_layers=2)
    hf = {k: v for k, v in theirs.to_dict().items() if k != "max_position_embeddings"}
    hf["architectures"] = [f"{family}ForCausalLM"]
    assert config_from_hf(hf).max_seq_len == theirs.max_position_embeddings


def test_a_family_added_without_its_hf_rules_fails_naming_where_they_go():
    """docs/contributing.md, A model family: a name added to FAMILIES reaches neither Qwen2's window rule nor its
    config.json keys by falling through; each says in one line which function needs the family's own branch."""
    import dataclasses

    from tasks.model import get_preset
    from tasks.model.hf_config import to_hf_config
    from tasks.shape import _windowed_layers

    with pytest.raises(StageError, match=r"^mistral: no rule for which layers slide: .* _windowed_layers"):
        _windowed_layers({"num_hidden_layers": 2, "sliding_window": 4096}, "mistral")
    tcfg = dataclasses.replace(get_preset("debug"), family="mistral", qkv_bias=False)
    with pytest.raises(StageError, match=r"^save_hf: no config.json keys for family mistral: .* to_hf_config"):
        to_hf_config(tcfg)
