"""AMCT (Ascend Model Compression Toolkit) flows. `amct_pytorch` ships with CANN and is imported lazily: on a host
without it, `amct_import_error()` names the cause and the plan refuses the backend in one line.

The API differs by release (hicann/amct): 8.5.0 offers only the LLM flow (`amct.quantize` / `amct.convert`);
9.0.0 and later (branches 9.0.0, 9.1.0, master) add the classic graph-based flow (`create_quant_config` /
`quantize_model` / `save_model` and the QAT `create_quant_retrain_config`) behind a lazy `__getattr__`. A flow is used
only when the installed package exposes every function it needs (`available_flows`), else it is refused in one line
naming what is missing.

- LLM flow (A2/A3 NPU): `amct.quantize(model, cfg)` → calibration forwards → `amct.convert(model)`, in place.
- Classic PTQ: `create_quant_config` → `quantize_model` → calibration → `save_model`, which writes
  `<prefix>_fake_quant_model.onnx` (ONNX Runtime accuracy check) and `<prefix>_deploy_model.onnx` (for ATC → .om).
- QAT hand-off when PTQ misses the gate: `retrain.cfg` + `create_quant_retrain_config` JSON.
"""

from __future__ import annotations

from pathlib import Path

from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, atomic_write_text
from tasks.quant.amct_config import llm_quant_config, qat_retrain_json, qat_simplified_cfg


# The functions each flow calls (tests/test_npu_api.py checks these names against AMCT's real sources).
FLOW_API = {
    "llm": ("quantize", "convert"),
    "ptq": ("create_quant_config", "quantize_model", "save_model"),
    "qat": ("create_quant_retrain_config", "create_quant_retrain_model", "save_quant_retrain_model"),
}
# AMCT's own requirement (hicann/amct README "CANN（Toolkit & Ops） ≥ 8.5.0", requirements.txt,
# docs/zh/quick_install.md): CANN >= 8.5.0, a CPU build of torch 2.1.0 or 2.7.1 with the torch_npu built for the
# installed CANN (Ascend/pytorch COMPATIBILITY.en.md: torch 2.7.1 → 2.7.1.post2 on CANN 8.5.0, 2.7.1.post4 on
# 9.0.0 — the one AMCT's requirements.txt and requirements-npu-amct.txt pin). tasks/envcheck/compat.check_amct holds
# the installed stack to it.
AMCT_TORCH = ("2.1.0", "2.7.1")
AMCT_MIN_CANN = "8.5.0"
AMCT_PAIR = (
    "AMCT needs CANN >= 8.5.0 and torch 2.1.0 or 2.7.1 (+cpu build) with the torch_npu built for that CANN "
    "(2.7.1.post2 on 8.5.0, 2.7.1.post4 on 9.0.0)"
)


def _exposes(module, name: str) -> bool:
    """hasattr that survives AMCT's lazy __getattr__ failing to import the classic flow's dependencies (onnx…)."""
    try:
        return getattr(module, name, None) is not None
    except Exception:  # noqa: BLE001 — an ImportError/RuntimeError inside AMCT's __getattr__ means "not usable"
        return False


def available_flows(module) -> dict[str, bool]:
    return {flow: all(_exposes(module, n) for n in names) for flow, names in FLOW_API.items()}


def require_flow(module, flow: str) -> None:
    missing = [n for n in FLOW_API[flow] if not _exposes(module, n)]
    if missing:
        offered = [f for f, ok in available_flows(module).items() if ok]
        version = getattr(module, "__version__", "") or "installed"
        raise StageError(
            f"AMCT ({version}) does not offer the {flow} flow (no amct_pytorch.{missing[0]}); "
            f"it offers: {', '.join(offered) or 'none'} — set quantize.amct_flow accordingly "
            f"(8.5.0 has only llm; ptq/qat need AMCT 9.0.0 or later: hicann/amct branches 9.0.0, 9.1.0)"
        )


def amct_import_error() -> str | None:
    """None when amct_pytorch imports, else the one-line cause (ImportError, or RuntimeError/OSError when CANN's
    libraries are missing)."""
    try:
        import amct_pytorch  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _amct(flow: str | None = None):
    err = amct_import_error()
    if err is not None:
        raise StageError(
            f"amct_pytorch is not importable ({err}); install AMCT from CANN on the Ascend host ({AMCT_PAIR})"
        )
    import amct_pytorch as amct

    if flow is not None:
        require_flow(amct, flow)
    return amct


def quantize_llm(model, method: str, skip_names, calib_batches, device) -> dict:
    """In place: calibration model → forwards over the calibration batches → deploy model with NPU INT8 ops."""
    amct = _amct("llm")  # first: without AMCT, the one-line cause before any work
    import torch

    cfg = llm_quant_config(method, skip_names, batch_num=len(calib_batches))
    amct.quantize(model, cfg)
    with torch.no_grad():
        for inputs, _ in calib_batches:
            model(inputs.to(device))
    amct.convert(model)
    return cfg


def quantize_ptq(model, skip_names, calib_batches, out_dir: Path, device=None) -> dict[str, str]:
    """Classic ONNX PTQ; returns the paths of the fake-quant and deploy models. The sample and every calibration
    batch go to the model's device, and attention runs export-friendly (AMCT exports at ONNX opset 11)."""
    amct = _amct("ptq")  # first: without AMCT, the one-line cause before any work
    import torch

    from tasks.quant.export import export_friendly

    device = device if device is not None else next(model.parameters()).device
    out_dir.mkdir(parents=True, exist_ok=True)
    config_file, record_file = out_dir / "config.json", out_dir / "record.txt"
    modified_onnx = out_dir / "modified_model.onnx"
    sample = (calib_batches[0][0].to(device),)
    with export_friendly(model):
        amct.create_quant_config(
            str(config_file),
            model,
            sample,
            skip_layers=list(skip_names),
            batch_num=len(calib_batches),
            activation_offset=True,
        )
        calibration_model = amct.quantize_model(
            str(config_file),
            str(modified_onnx),
            str(record_file),
            model,
            sample,
            input_names=["tokens"],
            output_names=["logits"],
            dynamic_axes={"tokens": {0: "batch", 1: "seq"}},
        )
        with torch.no_grad():
            for inputs, _ in calib_batches:
                calibration_model(inputs.to(device))
    prefix = out_dir / "model"
    amct.save_model(str(modified_onnx), str(record_file), str(prefix))
    outputs = {"fake_quant_onnx": f"{prefix}_fake_quant_model.onnx", "deploy_onnx": f"{prefix}_deploy_model.onnx"}
    missing = [p for p in outputs.values() if not Path(p).is_file()]
    if missing:
        raise StageError(f"amct.save_model did not write {missing[0]} (see ./amct_log/amct_pytorch.log)")
    return outputs


def write_qat_handoff(
    out_dir: Path, layers: list[tuple[str, str]], skip_names, batch_num: int, model=None, sample=None
) -> dict[str, str]:
    """Files for the QAT follow-up: the simplified `retrain.cfg`, and the per-layer JSON — written by AMCT's own
    `create_quant_retrain_config` when given the FP model (the AMCT backend), else in its format by us."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path, json_path = out_dir / "retrain.cfg", out_dir / "retrain_config.json"
    atomic_write_text(cfg_path, qat_simplified_cfg(skip_names, batch_num))
    if model is not None:
        amct = _amct("qat")  # first: without AMCT, the one-line cause before any work
        from tasks.quant.export import export_friendly

        with export_friendly(model):  # AMCT traces the model to ONNX (opset 11: no SDPA symbolic)
            amct.create_quant_retrain_config(str(json_path), model, sample, config_defination=str(cfg_path))
    else:
        atomic_write_json(json_path, qat_retrain_json(layers, batch_num), sort_keys=False)
    return {"retrain_cfg": str(cfg_path), "retrain_config_json": str(json_path)}


def quantize_retrain(model, skip_names, sample, out_dir: Path, train_fn):
    """AMCT QAT (the retrain flow): create_quant_retrain_config → create_quant_retrain_model (fake-quant retrain
    modules) → `train_fn(model)` → save_quant_retrain_model (fake-quant and deploy ONNX, like PTQ's save_model).
    → (the retrained torch model, train_fn's losses, the ONNX paths)."""
    amct = _amct()
    require_flow(amct, "qat")  # the retrain flow exists only where the package offers all three calls
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path, config_file = out_dir / "retrain.cfg", out_dir / "retrain_config.json"
    record_file = out_dir / "record.txt"
    atomic_write_text(cfg_path, qat_simplified_cfg(skip_names, 1))
    amct.create_quant_retrain_config(str(config_file), model, sample, config_defination=str(cfg_path))
    model = amct.create_quant_retrain_model(str(config_file), model, str(record_file), sample)
    losses = train_fn(model)
    model.eval()
    prefix = out_dir / "model"
    amct.save_quant_retrain_model(
        str(config_file),
        model,
        str(record_file),
        str(prefix),
        sample,
        input_names=["tokens"],
        output_names=["logits"],
        dynamic_axes={"tokens": {0: "batch", 1: "seq"}},
    )
    outputs = {"fake_quant_onnx": f"{prefix}_fake_quant_model.onnx", "deploy_onnx": f"{prefix}_deploy_model.onnx"}
    missing = [p for p in outputs.values() if not Path(p).is_file()]
    if missing:
        raise StageError(f"amct.save_quant_retrain_model did not write {missing[0]} (see ./amct_log/amct_pytorch.log)")
    return model, losses, outputs
