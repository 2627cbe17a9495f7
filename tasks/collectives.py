"""The one door to torch.distributed's collectives, with a strict mode that checks every call as HCCL or NCCL would.

Every collective and point-to-point call in tasks/ goes through the functions below (tests/test_collectives.py
refuses direct calls elsewhere). They take torch.distributed's arguments and do what it does; under
`LLM_PIPELINE_STRICT_COLLECTIVES=hccl` (or `=nccl`) each call is first checked against that backend's rules and a
violation raises `CollectiveRuleError` naming the backend rule, its upstream source and the call site.

The rules (each from the source that enforces it):
- Device: HCCL's process group serves NPU tensors only — "Tensors must be NPU and dense" (Ascend/pytorch
  torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, check_npu_single_tensor / check_npu_tensors_different_devices,
  branch v2.12.0-26.1.0; torch_npu registers `hccl` for the `npu` device only, torch_npu/_init/registry/
  distributed.py); NCCL's serves CUDA tensors only — "Tensors must be CUDA and dense" (pytorch/pytorch
  torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, check_gpu_single_tensor). Precisely: a tensor handed to a
  collective must be on the device type of the run, which is the device of the model's parameters (npu under HCCL,
  cuda under NCCL; on the CPU imitation below, cpu). A bookkeeping tensor made without `device=` lives on the CPU
  and breaks this rule on every accelerator run. On a CPU host every tensor is on the CPU, so this rule cannot
  fire there: tests/test_collectives.py checks it by naming the device type, and `make device-check` on a GPU.
- Dense and contiguous (the same functions: "Tensors must be contiguous"). Dense = the strided layout: every
  sparse layout (COO, CSR, CSC, BSR, BSC) is refused, in one line (a CSR tensor's `is_contiguous()` raises).
- Complex tensors: torch.distributed itself hands the backend `torch.view_as_real(t)` in all_reduce(_coalesced),
  broadcast, all_gather(_single/_coalesced), all_to_all(_single), scatter and isend/irecv (so send/recv), never in
  reduce, reduce_scatter(_single/_tensor) (torch/distributed/distributed_c10d.py, torch 2.13): the rules below
  apply to the real dtype there (complex64 → float32, complex128 → float64) and to the complex dtype itself in the
  others, where HCCL's table has no complex type. NCCL views complex as real in its reduce_scatter too (checked on
  an H200, torch 2.11.0+cu130: reduce_scatter_tensor of complex64 runs; 2026-12 device audit).
- Contiguity under NCCL is judged in the tensor's suggested memory format (the same H200 run: a channels_last
  tensor is all-reduced, a transposed one is refused with "Tensors must be contiguous"); HCCL's is kept to plain
  `is_contiguous()` (no device evidence either way).
- Data type per operation:
  HCCL (ProcessGroupHCCL.cpp `checkSupportedDataType`, identical on v2.10.0-26.0.0, v2.11.0-26.1.0,
  v2.12.0-26.1.0): the reducing operations (allreduce, allreduce_coalesced, reduce, _reduce_oop, reduce_scatter,
  _reduce_scatter_base, reduce_scatter_tensor_coalesced) take int8, int16, int32, int64, fp16, fp32, bf16 only —
  no fp64, no uint8 (master adds uint64/fp64 on Ascend950 only). allreduce and reduce first cast bool/uint8 to int32
  (their pre-hooks), so those two also take bool/uint8. The other operations (all-gather, broadcast, all-to-all,
  send/recv) take any type in HCCLUtils.cpp `kScalarTypeToHcclDataType`.
  NCCL (pytorch/pytorch torch/csrc/distributed/c10d/NCCLUtils.hpp `ncclDataType`, getNcclDataType: "Input tensor
  data type is not supported for NCCL process group"): int8, uint8, int32, int64, fp16, fp32, fp64, bf16, bool,
  fp8; ProcessGroupNCCL.cpp refuses fp8 in reductions ("Float8 dtypes are not currently supported for NCCL
  reductions").
- Project rule under strict=hccl: no fp64 on any operation. HCCL's own API takes fp64 for send/recv/all-gather
  (CANN hcclapiref, HcclSend), but its reductions do not, fp64 compute on an NPU runs on the AI CPU, and a fp64
  bookkeeping tensor that is sent today is reduced tomorrow: keep fp64 off the wire (the error says it is this
  project's rule).

On a CPU host strict mode also replaces gloo by `gloo_as_hccl` / `gloo_as_nccl` (`dist_backend()`): real gloo
process groups behind a ProcessGroup that checks every tensor first, so collectives that bypass this module —
FSDP2's all-gathers and reduce-scatters, DTensor's, the pipeline's send/recv, the trainer's direct calls (routed
here in wave 2) — are held to the same rules in CI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STRICT_ENV = "LLM_PIPELINE_STRICT_COLLECTIVES"
BACKENDS = ("hccl", "nccl")
DEVICE_TYPE = {"hccl": "npu", "nccl": "cuda"}
IMITATION = {"hccl": "gloo_as_hccl", "nccl": "gloo_as_nccl"}

_HCCL_REDUCE = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
)
_HCCL_ANY = _HCCL_REDUCE | {
    torch.uint8,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
}
_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
_NCCL_ANY = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.bool,
    }
    | _FP8
)
_REDUCING = {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter"}
_HCCL_CASTS = {"all_reduce", "all_reduce_coalesced", "reduce"}  # bool/uint8 → int32 before the check
# torch.distributed views a complex tensor as real before the backend sees it in these (distributed_c10d.py)
_VIEWED_AS_REAL = {"all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_to_all", "send", "recv"}
_NCCL_VIEWED_AS_REAL = _VIEWED_AS_REAL | {"reduce_scatter"}  # ProcessGroupNCCL views it itself (device audit)

HCCL_SOURCE = "Ascend/pytorch v2.12.0-26.1.0 torch_npu/csrc/distributed/ProcessGroupHCCL.cpp"
NCCL_SOURCE = "pytorch/pytorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp + NCCLUtils.hpp"


class CollectiveRuleError(RuntimeError):
    """A collective call that the imitated backend would refuse (strict mode)."""


def strict_backend() -> str | None:
    """ "hccl" / "nccl" when $LLM_PIPELINE_STRICT_COLLECTIVES asks for strict mode, None when unset/empty/0."""
    value = os.environ.get(STRICT_ENV, "").strip().lower()
    if value in ("", "0", "off"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"{STRICT_ENV}={value!r} is not one of hccl, nccl; unset it or pick one")
    return value


def allowed_dtypes(backend: str, op: str) -> frozenset:
    """The dtypes `backend` accepts for collective `op` (one of this module's function names)."""
    if backend == "hccl":
        if op in _REDUCING:
            return _HCCL_REDUCE | ({torch.bool, torch.uint8} if op in _HCCL_CASTS else set())
        return _HCCL_ANY
    return _NCCL_ANY - _FP8 if op in _REDUCING else _NCCL_ANY


def _dense_in_channels_last(t: torch.Tensor) -> bool:
    """Contiguous in the channels-last format of its rank (what C++'s suggest_memory_format picks for such a
    tensor; Python has no suggest_memory_format)."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def rule_violation(backend: str, op: str, t: torch.Tensor, device_type: str) -> str | None:
    """Why `backend` would refuse tensor `t` in collective `op` on a run whose device type is `device_type`."""
    source = HCCL_SOURCE if backend == "hccl" else NCCL_SOURCE
    name = backend.upper()
    if t.device.type != device_type:
        return (
            f"a {t.device.type} tensor on a {device_type} run: {name} serves {DEVICE_TYPE[backend]} tensors only "
            f'("Tensors must be {DEVICE_TYPE[backend].upper()} and dense", {source}; torch: "No backend type '
            f'associated with device type {t.device.type}"); create it with '
            f"device= the model's device"
        )
    if t.layout != torch.strided:
        return (
            f'a {str(t.layout).removeprefix("torch.")} tensor ("Tensors must be {DEVICE_TYPE[backend].upper()} '
            f'and dense", {source}); pass .to_dense()'
        )
    if not (t.is_contiguous() or (backend == "nccl" and _dense_in_channels_last(t))):
        return f'a non-contiguous tensor ("Tensors must be contiguous", {source}); pass .contiguous()'
    viewed = _NCCL_VIEWED_AS_REAL if backend == "nccl" else _VIEWED_AS_REAL
    dtype = t.dtype.to_real() if t.is_complex() and op in viewed else t.dtype
    shown = f"{t.dtype} (sent as {dtype}: torch views complex as real)" if dtype != t.dtype else str(t.dtype)
    if dtype not in allowed_dtypes(backend, op):
        ok = ", ".join(sorted(str(d).removeprefix("torch.") for d in allowed_dtypes(backend, op)))
        return f"{shown} is not supported by {name}'s {op} ({source}; takes {ok}); use float32 or int64"
    if backend == "hccl" and dtype == torch.float64:
        return (
            "float64 on the wire: this project's rule under strict=hccl (HCCL's reductions refuse fp64 before "
            "Ascend950, NPU fp64 compute runs on the AI CPU); send float32, or exact int64 (e.g. nanoseconds)"
        )
    return None


def call_site() -> str:
    """'path:line (function)' of the innermost caller in this repository outside this module (else the innermost
    caller outside torch), for error messages."""
    repo, here = Path(__file__).resolve().parent.parent, Path(__file__).resolve()
    fallback = None
    f = sys._getframe(1)
    while f is not None:
        p = Path(f.f_code.co_filename)
        if p != here and p.is_absolute():
            try:
                rel = p.resolve().relative_to(repo)
            except ValueError:
                rel = None
            if rel is not None and rel.parts[0] != ".venv":
                return f"{rel}:{f.f_lineno} ({f.f_code.co_name})"
            if fallback is None and "torch" not in p.parts:
                fallback = f"{p}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return fallback or "unknown call site"


def run_device_type(group=None) -> str:
    """The device type the run's collectives must use: npu under HCCL, cuda under NCCL, else (gloo, the CPU
    imitation) cpu."""
    try:
        name = dist.get_backend(group)
    except (RuntimeError, ValueError):
        name = ""
    return {"hccl": "npu", "nccl": "cuda"}.get(name, "cpu")


def check(op: str, tensors, group=None, backend: str | None = None, device_type: str | None = None) -> None:
    """Raise CollectiveRuleError when strict mode is on (or `backend` is given) and a tensor breaks a rule."""
    backend = backend or strict_backend()
    if backend is None:
        return
    device_type = device_type or run_device_type(group)
    for t in tensors:
        why = rule_violation(backend, op, t, device_type)
        if why:
            raise CollectiveRuleError(f"strict {backend}: {op} at {call_site()}: {why}")


# --- the layer: torch.distributed's signatures, checked first under strict mode --------------------------------


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    check("all_reduce", [tensor], group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """torch 2.13's name for reduce_scatter_tensor (deprecated there)."""
    check("reduce_scatter", [output, input], group)
    return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output, input, group=None, async_op: bool = False):
    """torch 2.13's name for all_gather_into_tensor (deprecated there)."""
    check("all_gather", [output, input], group)
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    check("all_gather", [*tensor_list, tensor], group)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    check("all_to_all", [output, input], group)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def broadcast(tensor, src: int | None = None, group=None, async_op: bool = False, group_src: int | None = None):
    check("broadcast", [tensor], group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)


def send(tensor, dst: int, group=None, tag: int = 0) -> None:
    check("send", [tensor], group)
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor, src: int | None = None, group=None, tag: int = 0):
    check("recv", [tensor], group)
    return dist.recv(tensor, src, group=group, tag=tag)


def barrier(group=None) -> None:
    dist.barrier(group=group)


# Object collectives pickle into uint8 tensors that torch itself places on the group's device
# (distributed_c10d._object_to_tensor / _get_object_coll_device): nothing of ours to check; here so that every
# collective of tasks/ has one door.
def all_gather_object(object_list: list, obj, group=None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> None:
    dist.broadcast_object_list(object_list, src=src, group=group)


# --- the CPU imitation: gloo behind a checking ProcessGroup ----------------------------------------------------


class _CheckedGloo(dist.ProcessGroup):
    """A real gloo process group whose every collective is first held to `backend`'s rules (strict mode on a CPU
    host). Reached from torch.distributed's Python API (method names as distributed_c10d calls them) and from C++
    (functional collectives, DTensor: the names torch's PyProcessGroup trampoline overrides)."""

    def __init__(self, store, rank: int, size: int, timeout, backend: str):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._backend = backend
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)

    def _check(self, op, *tensors) -> None:
        flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
        flat = [t for x in flat for t in (x if isinstance(x, (list, tuple)) else [x])]
        check(op, flat, backend=self._backend, device_type="cpu")

    def getBackendName(self) -> str:
        return IMITATION[self._backend]

    def allreduce(self, tensors, opts=None):
        self._check("all_reduce", tensors)
        return self._gloo.allreduce(tensors, opts) if opts is not None else self._gloo.allreduce(tensors)

    def allreduce_coalesced(self, tensors, opts):
        self._check("all_reduce_coalesced", tensors)
        return self._gloo.allreduce_coalesced(tensors, opts)

    def reduce(self, tensors, opts):
        self._check("reduce", tensors)
        return self._gloo.reduce(tensors, opts)

    def broadcast(self, tensors, opts):
        self._check("broadcast", tensors)
        return self._gloo.broadcast(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        self._check("all_gather", outputs, inputs)
        return self._gloo.allgather(outputs, inputs, opts)

    def allgather_coalesced(self, outputs, inputs, opts):
        self._check("all_gather", outputs, inputs)
        return self._gloo.allgather_coalesced(outputs, inputs, opts)

    def all_gather_single(self, output, input, opts):
        self._check("all_gather", output, input)
        return self._gloo._allgather_base(output, input, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        self._check("all_gather", outputs, inputs)
        works = [self._gloo._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        for w in works[:-1]:
            w.wait()
        return works[-1]

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, inputs, opts):
        self._check("reduce_scatter", outputs, inputs)
        return self._gloo.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts):
        self._check("reduce_scatter", output, input)
        return self._gloo._reduce_scatter_base(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        self._check("reduce_scatter", outputs, inputs)
        works = [self._gloo._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        for w in works[:-1]:
            w.wait()
        return works[-1]

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        self._check("all_to_all", output, input)
        return self._gloo.alltoall_base(output, input, output_splits, input_splits, opts)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts):
        self._check("all_to_all", outputs, inputs)
        return self._gloo.alltoall(outputs, inputs, opts)

    def send(self, tensors, dst: int, tag: int):
        self._check("send", tensors)
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        self._check("recv", tensors)
        return self._gloo.recv(tensors, src, tag)

    def barrier(self, opts=None):
        return self._gloo.barrier(opts) if opts is not None else self._gloo.barrier()


def _registered(backend: str) -> str:
    name = IMITATION[backend]
    if name.upper() not in dist.Backend._plugins:

        def create(store, rank, size, timeout):
            return _CheckedGloo(store, rank, size, timeout, backend)

        dist.Backend.register_backend(name, create, devices=["cpu"])
    return name


def dist_backend(kind: str) -> str:
    """The process-group backend of a `kind` run: hccl / nccl / gloo, or on CPU under strict mode the checking
    imitation of the strict backend (registered on first use, in this process)."""
    if kind != "cpu":
        return {"npu": "hccl", "cuda": "nccl"}[kind]
    strict = strict_backend()
    return _registered(strict) if strict else "gloo"
