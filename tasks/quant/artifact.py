"""The quantized model on disk: `model_int8.pt` (a plain state dict of int8 tensors + scales; it loads with
`torch.load(weights_only=True)` once torchao is imported, which registers its tensor classes as safe) beside
`quant_meta.json` (method, backend, layers, sizes, and the HF directory whose config rebuilds the skeleton).

torchao artifacts also come as `model_int8.safetensors` + `quantization_config.json`: the same tensors flattened by
torchao's own safetensors support (torchao/prototype/safetensors/safetensors_support.py, torchao 0.18: int8 qdata,
scales and zero points as plain tensors, each subclass's type and attributes as JSON in the file's metadata) — no
pickle; `load_quantized(..., source="safetensors")` rebuilds the model from them."""

from __future__ import annotations

import enum
import pickle
import types
from collections import Counter
from pathlib import Path

import torch

from tasks.errors import StageError
from tasks.fsutil import read_json
from tasks.quant.plan import Layer

WEIGHTS, META = "model_int8.pt", "quant_meta.json"
SAFETENSORS, QUANT_CONFIG = "model_int8.safetensors", "quantization_config.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def describe_layers(model: torch.nn.Module) -> list[Layer]:
    """Leaf modules as plan rows: name, class name, weight shape, and whether the weight is shared (tied)."""
    from tasks.model.transformer import TiedOutput

    leaves = [(n, m) for n, m in model.named_modules() if n and next(m.children(), None) is None]
    # MoE routed experts hold stacked w1/w2/w3 [E, out, in] instead of one weight (tasks/model/moe.py)
    weights = [getattr(m, "weight", getattr(m, "w1", None)) for _, m in leaves]
    holders = Counter(id(w) for w in weights if isinstance(w, torch.Tensor))
    # A tied model's output projection is an nn.Linear whose training backward copies its gradient: a Linear here.
    return [
        Layer(
            n,
            "Linear" if isinstance(m, TiedOutput) else type(m).__name__,
            tuple(w.shape) if isinstance(w, torch.Tensor) else (),
            isinstance(w, torch.Tensor) and holders[id(w)] > 1,
        )
        for (n, m), w in zip(leaves, weights)
    ]


class _EnumByValuePickler(pickle.Pickler):
    """Enum members pickled by value, `Class(value)`, on every Python. torchao's tensor subclasses carry enums
    (MappingType, KernelPreference …) that torchao registers as safe globals; CPython 3.11.2 (Debian 12's) pickles a
    member by name through `builtins.getattr` (Lib/enum.py, Enum.__reduce_ex__: `return getattr, (self.__class__,
    self._name_)`), a global torch.load(weights_only=True) refuses ("Unsupported global: GLOBAL getattr"), where
    3.11.7 and 3.12 pickle `self.__class__, (self._value_,)`: without this, an INT8 model quantized on Debian's
    Python could never be loaded (and the safe path must not allow getattr)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return type(obj), (obj._value_,)
        return NotImplemented


# torch.save's pickle_module: a module with a Pickler (torch/serialization.py, _save subclasses pickle_module.Pickler)
ENUM_BY_VALUE = types.ModuleType("enum_by_value_pickle")
ENUM_BY_VALUE.Pickler = _EnumByValuePickler


def save_model(model: torch.nn.Module, path: Path, fmt: str) -> None:
    """torch_state_dict (torchao): tensors only, rebuilt onto our skeleton at load. torch_module (AMCT LLM flow):
    amct.convert swaps Linear for AMCT's deploy modules, which only AMCT can construct, so the module is pickled."""
    obj = model.state_dict() if fmt == "torch_state_dict" else model
    torch.save(obj, path, pickle_module=ENUM_BY_VALUE)


def save_safetensors(model: torch.nn.Module, quant_dir: Path, meta: dict) -> dict:
    """The torchao INT8 state dict as `model_int8.safetensors` + `quantization_config.json` in `quant_dir`;
    → {"safetensors_bytes", "safetensors_sha256"} for quant_meta.json."""
    import torchao
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    from tasks.fsutil import atomic_write_json, sha256_file

    state, seen = {}, set()
    for k, v in model.state_dict().items():  # a tied output/embedding pair: stored once (safetensors refuses both)
        ptr = v.untyped_storage().data_ptr() if type(v) is torch.Tensor else id(v)
        if ptr not in seen:
            seen.add(ptr)
            state[k] = v
    tensors, metadata = flatten_tensor_state_dict(state)
    path = quant_dir / SAFETENSORS
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    out = {"safetensors_bytes": path.stat().st_size, "safetensors_sha256": sha256_file(path)}
    config = atomic_write_json(
        quant_dir / QUANT_CONFIG,
        {
            "quant_method": "torchao",
            "torchao_version": torchao.__version__,
            "weights": SAFETENSORS,
            "sha256": out["safetensors_sha256"],
            "method": meta["method"],
            "dtype": meta.get("dtype", "bf16"),
            "quantized_layers": meta["quantized_layers"],
            "skipped_layers": meta["skipped_layers"],
            "tied_layers_stored_once": sorted(set(model.state_dict()) - set(state)),
            "config": "config.json of the HF export (model_dir in quant_meta.json; registered beside it)",
        },
    )
    out["quant_config_sha256"] = sha256_file(config)  # what registers it: checked by verify_output like the weights
    return out


def _read_safetensors(quant_dir: Path, device) -> dict:
    """The torchao state dict back from `model_int8.safetensors` (its sha256 checked by verify_output)."""
    path = quant_dir / SAFETENSORS
    if not read_json(quant_dir / META).get("safetensors_sha256"):
        raise StageError(f"{path} is missing; rerun the quantize stage (it writes it for torchao artifacts)")
    return _unflatten(path, device)


def _unflatten(path: Path, device) -> dict:
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    with safe_open(str(path), "pt", device=str(device)) as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    state, left = unflatten_tensor_state_dict(tensors, metadata)
    return {**state, **left}


ONNX_KEYS = ("fake_quant_onnx", "deploy_onnx")


def onnx_record(quant_dir: Path, meta: dict, written_in: Path) -> dict:
    """AMCT's ONNX paths, written under the temporary folder `written_in`, pointed at the published `quant_dir`,
    with their sizes ("onnx_bytes", checked by verify_output)."""
    paths = {k: str(quant_dir / Path(meta[k]).relative_to(written_in)) for k in ONNX_KEYS if k in meta}
    return dict(paths, onnx_bytes={k: Path(p).stat().st_size for k, p in paths.items()})


def _onnx_problem(meta: dict) -> str | None:
    sizes = meta.get("onnx_bytes") or {}
    for k in ONNX_KEYS:
        if k not in meta:
            continue
        path = Path(meta[k])
        if not path.is_file():
            return f"{path} is missing"
        if k in sizes and path.stat().st_size != sizes[k]:
            return f"{path} is truncated or altered ({path.stat().st_size} bytes, {sizes[k]} recorded in {META})"
    return None


def verify_output(quant_dir: str | Path) -> str | None:
    """None when the saved INT8 files (weights, safetensors + quantization_config.json, AMCT's ONNX models) match the
    sizes and sha256 recorded at write, else the problem in one line (checksums an older result lacks are not
    asked for)."""
    from tasks.fsutil import sha256_file

    quant_dir = Path(quant_dir)
    meta = read_json(quant_dir / META)
    want = meta.get("weights_sha256")
    if meta.get("format") == "onnx" or any(k in meta for k in ONNX_KEYS):
        problem = _onnx_problem(meta)
        if problem or meta.get("format") == "onnx":
            return problem
    if want is None:
        return None
    path = quant_dir / WEIGHTS
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != meta["int8_bytes"]:
        return f"{path} is truncated or altered ({path.stat().st_size} bytes, {meta['int8_bytes']} recorded)"
    if sha256_file(path) != want:
        return f"{path} is corrupt (sha256 differs from the one recorded in {META})"
    st = quant_dir / SAFETENSORS
    if meta.get("safetensors_sha256") and (not st.is_file() or sha256_file(st) != meta["safetensors_sha256"]):
        return f"{st} is missing or corrupt (sha256 differs from the one recorded in {META})"
    qc = quant_dir / QUANT_CONFIG
    if meta.get("safetensors_sha256") and not qc.is_file():
        return f"{qc} is missing"
    if meta.get("quant_config_sha256") and sha256_file(qc) != meta["quant_config_sha256"]:
        return f"{qc} is corrupt (sha256 differs from the one recorded in {META})"
    return None


def pip_requirements(meta: dict) -> list[str]:
    """What a registered model needs to load: torch, plus torchao (its version) for torchao artifacts, or torch_npu
    (and AMCT, shipped with CANN, not pip-installable) for AMCT ones. Imports torchao only when the artifact is its."""
    reqs = [f"torch=={torch.__version__.split('+')[0]}"]
    if meta.get("backend") == "torchao":
        import torchao

        reqs.append(f"torchao=={torchao.__version__}")
    elif meta.get("backend") == "amct":
        from tasks.device import package_version

        npu = package_version("torch-npu")
        reqs.append(f"torch-npu=={npu}" if npu else "torch-npu")
    return reqs


def _pickled_module_allowed(quant_dir: Path, meta: dict) -> None:
    """An AMCT deploy model is a pickle (its modules are not safe globals): unpickling runs code from the file. It is
    loaded only with the sha256 its quantize stage recorded and only where AMCT is importable (the Ascend host that
    made it): anywhere else, a quant_meta.json saying "torch_module" is refused before the file is opened."""
    if not meta.get("weights_sha256"):
        raise StageError(
            f"{quant_dir}: a pickled INT8 module without the sha256 its quantize stage records is not loaded "
            "(unpickling runs code from the file); rerun the quantize stage"
        )
    from tasks.quant.amct_backend import amct_import_error

    problem = amct_import_error()
    if problem:
        raise StageError(
            f"{quant_dir}: an AMCT deploy model (pickled modules) loads only where AMCT is installed ({problem}); "
            "evaluate it on the Ascend host that quantized it"
        )


def load_quantized(quant_dir: str | Path, device="cpu", pack: bool = True, source: str = "pt") -> torch.nn.Module:
    """The saved INT8 model on `device`, ready for evaluation. torchao is imported only for its own artifacts: an
    AMCT host has no torchao and must not need it. On the CPU, `pack` runs torchao's INT8 weight-only layers through
    PyTorch's fused int8 kernels (torchao_backend.pack_for_cpu: same weights and scales, faster); pack=False keeps
    torchao's own eager path (what the benchmark compares against). `source="safetensors"`: the torchao tensors from
    `model_int8.safetensors` instead of the torch.save file."""
    from tasks.model.hf_io import read_hf_config

    quant_dir = Path(quant_dir)
    if not (quant_dir / META).is_file():
        raise StageError(f"{quant_dir}: no quantized model ({META}); run the quantize stage first")
    meta = read_json(quant_dir / META)
    if meta["format"] == "onnx":
        raise StageError(
            f"{quant_dir}: AMCT PTQ wrote ONNX models ({meta['deploy_onnx']}); evaluate the fake-quant "
            "ONNX with onnxruntime or the deploy model after ATC on the Ascend host"
        )
    problem = verify_output(quant_dir) if (quant_dir / WEIGHTS).is_file() else f"{quant_dir / WEIGHTS} is missing"
    if problem:
        raise StageError(f"{problem}; rerun the quantize stage (it rebuilds it)")
    if meta["format"] == "torch_module":
        _pickled_module_allowed(quant_dir, meta)
    try:
        if meta["format"] == "torch_module":
            # Pickled AMCT deploy module: our own quantize stage wrote it into this run directory, and its sha256 was
            # checked above against quant_meta.json. Not weights_only: AMCT's deploy classes are not registered as
            # safe globals (an Ascend host could add them with torch.serialization.add_safe_globals).
            return torch.load(quant_dir / WEIGHTS, map_location=device, weights_only=False).eval()
        # torchao registers its tensor subclasses and their enums as safe globals on import (torchao 0.18:
        # torch.serialization.add_safe_globals in quantization/granularity.py, quant_primitives.py, …), so the INT8
        # state dict loads with weights_only=True: no code runs from the file.
        import torchao  # noqa: F401

        if source == "safetensors":
            state = _read_safetensors(quant_dir, device)
        else:
            state = torch.load(quant_dir / WEIGHTS, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # truncated/corrupt, no checksum
        raise StageError(
            f"{quant_dir / WEIGHTS} is unreadable ({str(e).splitlines()[0][:200]}); rerun the quantize "
            "stage (it rebuilds it)"
        ) from None
    return _assemble(state, read_hf_config(meta["model_dir"]), meta["quantized_layers"], device, pack)


def load_registered_files(directory: Path, device="cpu", pack: bool = True) -> torch.nn.Module:
    """A registered INT8 version's model without unpickling anything: the extra files evaluate registers with it
    (config.json, model_int8.safetensors, quantization_config.json; the safetensors' sha256 checked against the
    config's). What a champion comparison loads: a registry entry is data, never code."""
    from tasks.fsutil import sha256_file
    from tasks.model.hf_io import read_hf_config

    directory = Path(directory)
    qc = read_json(directory / QUANT_CONFIG)
    path = directory / SAFETENSORS
    if sha256_file(path) != qc.get("sha256"):
        raise StageError(f"{path} is corrupt (sha256 differs from {QUANT_CONFIG}'s); register the version again")
    import torchao  # noqa: F401  (its tensor subclasses, rebuilt from the flattened tensors)

    state = _unflatten(path, device)
    return _assemble(state, read_hf_config(directory), qc["quantized_layers"], device, pack)


def _assemble(state: dict, tcfg, quantized_layers: list, device, pack: bool) -> torch.nn.Module:
    """Our skeleton on the meta device with the INT8 state assigned, ties and RoPE restored, packed on CPU."""
    from tasks.model.transformer import build_model, rope_table

    model = build_model(tcfg, device="meta")  # no memory: every tensor is assigned from the file
    if tcfg.tie_embeddings and "output.weight" not in state:  # stored once in the safetensors form
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, assign=True)
    if tcfg.tie_embeddings and not {"output", "tok_embeddings"} & set(quantized_layers):
        model.tie_weights()  # quantizing either one gave each its own weight in the file
    model.rope_cache = rope_table(tcfg.head_dim, tcfg.max_seq_len, tcfg.rope_theta, device=device)
    if pack and torch.device(device).type == "cpu":
        from tasks.quant.torchao_backend import pack_for_cpu

        pack_for_cpu(model)
    return model.eval()
