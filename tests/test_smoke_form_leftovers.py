"""Two leftovers: smoke's CPU comparison (smoke.compare_with_cpu) built both of its models without
`model.converters`, so with qat_int8 it compared a function training does not train (and the device side never ran
npu_fused's kernels); the trigger form's Model preset was free text, a typo refused only by the run's first task."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    from tasks.config import load_config
    from tasks.model import build_model, get_preset, materialize

    cfg = load_config("ci-tiny", overrides={"model.converters": ["qat_int8"], "smoke.compare_precision": "fp32"})
    tcfg = get_preset("debug")
    state = materialize(build_model(tcfg), "cpu", seed=3).state_dict()
    tokens = torch.randint(0, tcfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    return cfg, tcfg, state, tokens


def test_the_cpu_reference_computes_the_converted_function(tiny):
    """qat_int8's fake-quantized weights change the function: the plain model's logits differ from the converted
    one's, so an unconverted CPU reference would report that gap as the device's error. Both sides now apply the
    converters (FP32 against FP32 on the CPU: exactly equal), and smoke passes model.converters through."""
    from tasks.model import compare as cmp
    from tasks.model.converters import ConvertContext, build
    from tasks.stages.smoke import compare_precision

    cfg, tcfg, state, tokens = tiny
    cpu, off = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    plain = cmp.capture(cmp._model(tcfg, state, cpu), tokens, off)
    converted = build(["qat_int8"], ConvertContext("cpu", tcfg, cfg))
    fake_quant = cmp.capture(cmp._model(tcfg, state, cpu, converted), tokens, off)
    assert cmp.compare(plain, fake_quant, 0.0)["logits_max_rel"] > 1e-3  # the unconverted reference differs

    out = compare_precision(cfg, tcfg, state, tokens, cpu)  # smoke's call: cfg.model.converters, on both sides
    assert (out["precision"], out["max_rel"], out["first_beyond"]) == ("fp32", 0.0, None), cmp.summary(out)
    applied = f"qat_int8(int8_weight_only: {len(converted[0].swapped)} Linear)"
    assert out["converters"] == {"device": [applied], "cpu": [applied]}, out["converters"]


def test_model_preset_is_a_dropdown_of_the_registered_presets():
    """The Param's enum is tasks.shape.PRESETS (the config model's JSON schema, which refuses the same names): a
    trigger conf with a typo is refused by Airflow's Param validation, in its first line, before any task runs."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.definitions.param import ParamValidationError

    from tasks.config import load_config
    from tasks.errors import ConfigError
    from tasks.pipeline import param_schemas
    from tasks.shape import PRESETS

    assert param_schemas()["model_preset"]["enum"] == [*PRESETS, None]
    bag = DagBag(dag_folder=str(REPO / "dags" / "llm_pipeline.py"))
    assert bag.import_errors == {}, bag.import_errors
    params = bag.dags["llm_pipeline"].params
    for name in [*PRESETS, None]:
        copy.deepcopy(params).update({"model_preset": name})
    with pytest.raises(ParamValidationError) as e:
        copy.deepcopy(params).update({"model_preset": "qwen2-7"})
    first = str(e.value).splitlines()[0]  # Airflow's line; jsonschema's schema dump follows it
    assert first.startswith("Invalid input for param model_preset: 'qwen2-7' is not one of ['debug', 'demo',"), first

    with pytest.raises(ConfigError) as e:  # the config refuses the same name, in one line
        load_config("ci-tiny", overrides={"model.preset": "qwen2-7"})
    assert str(e.value) == f"model.preset: unknown preset 'qwen2-7' (known: {', '.join(PRESETS)})"
    assert load_config("ci-tiny", overrides={"model.preset": "mine", "model.hf_path": "/m"}).model.preset == "mine"
