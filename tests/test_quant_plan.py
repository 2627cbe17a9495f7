"""The AMCT path's configuration and decision logic, on a machine without AMCT (pure functions, no torch)."""

from __future__ import annotations

import json

import pytest

from tasks.errors import StageError
from tasks.quant.amct_config import jsonable, llm_quant_config, qat_retrain_json, qat_simplified_cfg
from tasks.quant.plan import Layer, choose_backend, gate_advice, hf_name, is_skipped, select_layers

LLAMA = [
    Layer("tok_embeddings", "Embedding", (256, 64)),
    Layer("layers.0.attention_norm", "RMSNorm", (64,)),
    Layer("layers.0.attention.wq", "Linear", (64, 64)),
    Layer("layers.0.feed_forward.w2", "Linear", (64, 128)),
    Layer("norm", "RMSNorm", (64,)),
    Layer("output", "Linear", (256, 64)),
]


def test_llm_configs_match_amct_predefined_shapes():
    # INT8_MINMAX_WEIGHT_QUANT_CFG and INT8_SMOOTHQUANT_CFG of amct_pytorch/common/config/config.py, key for key.
    assert llm_quant_config("int8_weight_only", {"lm_head"}) == {
        "batch_num": 1,
        "quant_cfg": {"weights": {"type": "int8", "symmetric": True, "strategy": "channel"}},
        "algorithm": {"minmax"},
        "skip_layers": {"lm_head"},
    }
    assert llm_quant_config("smoothquant", ["lm_head"]) == {
        "batch_num": 1,
        "quant_cfg": {
            "weights": {"type": "int8", "symmetric": True, "strategy": "channel"},
            "inputs": {"type": "int8", "symmetric": True, "strategy": "tensor"},
        },
        "algorithm": {"smoothquant": {"smooth_strength": 0.5}},
        "skip_layers": {"lm_head"},
    }
    w8a8 = llm_quant_config("int8_dynamic", ["output", "tok_embeddings"], batch_num=4)
    assert w8a8["algorithm"] == {"minmax"} and "inputs" in w8a8["quant_cfg"] and w8a8["batch_num"] == 4
    assert json.loads(json.dumps(jsonable(w8a8)))["skip_layers"] == ["output", "tok_embeddings"]
    with pytest.raises(StageError, match="int4"):
        llm_quant_config("int4", [])


def test_qat_handoff_formats():
    doc = qat_retrain_json([("layers.0.attention.wq", "Linear"), ("conv1", "Conv2d")], batch_num=2)
    assert doc["version"] == 1 and doc["batch_num"] == 2
    assert doc["conv1"] == {
        "retrain_enable": True,
        "retrain_data_config": {"algo": "ulq_quantize", "dst_type": "INT8"},
        "retrain_weight_config": {"algo": "arq_retrain", "channel_wise": True, "dst_type": "INT8"},
    }
    assert doc["layers.0.attention.wq"]["retrain_weight_config"]["channel_wise"] is False
    cfg = qat_simplified_cfg(["output", "tok_embeddings"], batch_num=2)
    assert "batch_num: 2" in cfg and 'skip_layers: "output"' in cfg and "arq_retrain: {" in cfg
    assert cfg.count("{") == cfg.count("}")


def test_skip_patterns_match_our_and_hf_names():
    assert hf_name("layers.3.feed_forward.w2") == "model.layers.3.mlp.down_proj"  # transformers' module path
    assert hf_name("output") == "lm_head" and hf_name("tok_embeddings") == "model.embed_tokens"
    assert is_skipped("layers.0.feed_forward.w3", ["model.layers.0."])  # was "matches no layer"
    assert not is_skipped("layers.10.feed_forward.w3", ["model.layers.1."]) and not is_skipped("output", ["model."])
    assert is_skipped("output", ["lm_head"]) and is_skipped("tok_embeddings", ["embed"])
    assert is_skipped("layers.0.feed_forward.w2", ["down_proj"]) and not is_skipped("layers.0.attention.wq", ["wk"])
    assert not is_skipped("layers.0.attention.wq", ["", "lm_head"])


@pytest.mark.parametrize(
    "requested,err,kind,flow,expected",
    [
        ("auto", None, "npu", "llm", "amct"),  # Ascend host with AMCT
        ("auto", "No module named 'amct_pytorch'", "npu", "llm", "torchao"),
        ("auto", None, "cpu", "llm", "torchao"),  # AMCT without an NPU: torchao
        ("amct", None, "cpu", "ptq", "amct"),  # classic ONNX PTQ runs on CPU
        ("torchao", None, "npu", "llm", "torchao"),
    ],
)
def test_backend_choice(requested, err, kind, flow, expected):
    assert choose_backend(requested, err, kind, flow) == expected


def test_backend_refusals_are_one_line():
    with pytest.raises(StageError, match=r"amct_pytorch is not importable \(No module named 'amct_pytorch'\)") as e:
        choose_backend("amct", "No module named 'amct_pytorch'", "npu", "llm")
    assert "\n" not in str(e.value) and "quantize.backend=torchao" in str(e.value)
    with pytest.raises(StageError, match="Ascend A2/A3 NPUs only, this host is cpu"):
        choose_backend("amct", None, "cpu", "llm")


def test_without_amct_flows_fail_in_one_line_and_qat_files_are_still_written(tmp_path):
    from tasks.quant.amct_backend import amct_import_error, quantize_llm, quantize_ptq, write_qat_handoff

    assert "amct_pytorch" in amct_import_error()
    for call in (
        lambda: quantize_llm(None, "int8_weight_only", [], [], "cpu"),
        lambda: quantize_ptq(None, [], [], tmp_path),
        lambda: write_qat_handoff(tmp_path / "qat", [], [], 1, model=object(), sample=()),
    ):
        with pytest.raises(StageError, match=r"^amct_pytorch is not importable \(No module named 'amct_pytorch'\)"):
            call()
    files = write_qat_handoff(tmp_path / "qat", [("layers.0.attention.wq", "Linear")], ["output"], 2)
    assert json.loads(open(files["retrain_config_json"]).read())["layers.0.attention.wq"]["retrain_enable"] is True
    assert 'skip_layers: "output"' in open(files["retrain_cfg"]).read()


def test_layer_selection_and_unsupported_layers():
    assert select_layers(LLAMA, "torchao", "llm", "int8_weight_only", ["lm_head", "embed"]) == [
        "layers.0.attention.wq",
        "layers.0.feed_forward.w2",
    ]
    assert (
        select_layers(LLAMA, "torchao", None, "int8_weight_only", [])[0] == "tok_embeddings"
    )  # torchao: embeddings too
    with pytest.raises(
        StageError,
        match=r"layer tok_embeddings \(Embedding\) is not supported by amct llm "
        r"int8_weight_only \(supports Linear\); add it to quantize.skip_layers",
    ):
        select_layers(LLAMA, "amct", "llm", "int8_weight_only", ["lm_head"])
    conv1d = LLAMA + [Layer("layers.0.mixer", "Conv1d", (64, 1, 4))]
    with pytest.raises(StageError, match=r"Conv1d\) is not supported by torchao int8_dynamic \(supports Linear, Embed"):
        select_layers(conv1d, "torchao", None, "int8_dynamic", ["output"])
    with pytest.raises(StageError, match=r"Conv1d\) is not supported by amct ptq"):
        select_layers(conv1d, "amct", "ptq", "int8_dynamic", ["lm_head", "embed"])
    assert "layers.0.mixer" not in select_layers(conv1d, "torchao", None, "int8_dynamic", ["embed", "output", "mixer"])
    with pytest.raises(StageError, match="no layer left"):
        select_layers(LLAMA, "torchao", None, "int8_dynamic", ["layers", "embed", "output"])


def test_amct_layer_constraints():
    tied = [Layer("tok_embeddings", "Embedding", (256, 64), shared=True), Layer("output", "Linear", (256, 64), True)]
    with pytest.raises(StageError, match="shares its weight"):
        select_layers(tied, "amct", "ptq", "int8_dynamic", ["embed"])
    odd = [Layer("proj", "Linear", (48, 40))]
    with pytest.raises(StageError, match="not 32-aligned"):
        select_layers(odd, "amct", "llm", "int8_weight_only", [])
    with pytest.raises(StageError, match="K % 16 == 0"):
        select_layers(odd, "amct", "llm", "smoothquant", [])
    assert select_layers(odd, "torchao", None, "int8_weight_only", []) == ["proj"]


def test_gate_advice_names_the_remedies():
    tips = gate_advice("int8_dynamic", "amct")
    assert "SmoothQuant" in tips and "skip_layers" in tips and "create_quant_retrain_model" in tips
    assert "SmoothQuant" not in gate_advice("smoothquant", "torchao") and "QAT" in gate_advice("smoothquant", "torchao")
    assert "model.converters=[qat_int8, npu_fused]" in gate_advice("int8_weight_only", "torchao")


def test_a_tied_models_output_projection_is_a_shared_linear():
    import dataclasses

    from tasks.model import build_model, get_preset
    from tasks.quant.artifact import describe_layers

    tied = build_model(dataclasses.replace(get_preset("debug"), tie_embeddings=True), "meta")
    rows = {layer.name: layer for layer in describe_layers(tied)}
    assert rows["output"].type == "Linear" and rows["output"].shared and rows["tok_embeddings"].shared
    with pytest.raises(StageError, match="output shares its weight"):
        select_layers(list(rows.values()), "amct", "ptq", "int8_dynamic", ["tok_embeddings"])
