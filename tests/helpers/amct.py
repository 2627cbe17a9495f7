"""A stand-in `amct_pytorch` for the classic PTQ flow (AMCT is not on PyPI): its three calls with the real API's
signatures (hicann/amct master, tests/fixtures/npu_api/amct_pytorch-master.json; tests/test_npu_api.py checks the
snapshot), recording what they are given and writing the two ONNX files save_model writes."""

from __future__ import annotations

import types
from pathlib import Path


def fake_amct_ptq(on_config=None, onnx: bytes = b"") -> types.ModuleType:
    """The module; `on_config(config_file, model, input_data)` runs inside create_quant_config."""
    fake = types.ModuleType("amct_pytorch")

    def create_quant_config(
        config_file, model, input_data, skip_layers=None, batch_num=1, activation_offset=True, config_defination=None
    ):
        if on_config:
            on_config(config_file, model, input_data)

    def quantize_model(
        config_file,
        modfied_onnx_file,
        record_file,
        model,
        input_data,
        input_names=None,
        output_names=None,
        dynamic_axes=None,
    ):
        return model

    def save_model(modfied_onnx_file, record_file, save_path):
        for suffix in ("_fake_quant_model.onnx", "_deploy_model.onnx"):
            Path(f"{save_path}{suffix}").write_bytes(onnx)

    fake.create_quant_config, fake.quantize_model, fake.save_model = create_quant_config, quantize_model, save_model
    fake.quantize = fake.convert = lambda *a, **k: None
    return fake
