"""Unsupported / fallback operators: which operators left the NPU (torch_npu's CPU fallback, AI CPU kernels), where
the model's code asks for them, and the guides' advice. On CPU/CUDA the report is empty and says why.

torch_npu prints, once per operator (its npu_cpu_fallback kernel; seen e.g. in Ascend/pytorch#40, #51):
  [W compiler_depend.ts:51] Warning: CAUTION: The operator 'aten::isin.Tensor_Tensor_out' is not currently supported
  on the NPU backend and will fall back to run on the CPU. This may have performance implications. (function
  npu_cpu_fallback)
which reaches Python as a warning; the smoke stage records warnings while it runs. AI CPU operators come from the
profile (kernel_details / op_summary rows with Accelerator Core / Task Type AI_CPU).
"""

from __future__ import annotations

import re
from pathlib import Path

FALLBACK_RE = re.compile(
    r"The operator '([^']+)' is not currently supported on the NPU backend and will fall back "
    r"to run on the CPU"
)
MODEL_DIR = Path(__file__).resolve().parent
ADVICE = [
    "replace the call with an equivalent the NPU supports (often another dtype: int64/double → int32/float, "
    "or a different formulation of the same math)",
    "use the fused torch_npu operator where one exists (torch_npu.npu_rms_norm, npu_rotary_mul, npu_swiglu, "
    "npu_fusion_attention)",
    "for a hot operator with no equivalent, write a custom AscendC operator",
]
WHY_EMPTY = {
    "cpu": "cpu: every operator runs natively on the host CPU; AI CPU kernels and NPU→CPU fallback exist only on "
    "Ascend, so there is nothing to list",
    "cuda": "cuda: PyTorch's CUDA backend has no AI CPU and no silent CPU fallback (an unsupported operator raises "
    "NotImplementedError), so there is nothing to list",
}


def fallback_ops(texts) -> list[str]:
    """Operator names from torch_npu's fallback warnings, first appearance first."""
    found = []
    for t in texts:
        found += FALLBACK_RE.findall(str(t))
    return list(dict.fromkeys(found))


def where_called(op: str, sources: list[Path] | None = None) -> list[str]:
    """file:line of the model code calling the operator ('aten::isin.Tensor_Tensor_out' → isin(…))."""
    base = op.split("::")[-1].split(".")[0].lstrip("_")
    if not base:
        return []
    pattern = re.compile(rf"(?<![\w]){re.escape(base)}\s*\(")
    hits = []
    for path in sources if sources is not None else sorted(MODEL_DIR.glob("*.py")):
        for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith(("#", "def ")):
                hits.append(f"{Path(path).name}:{i}")
    return hits


def report(kind: str, warnings_text=(), ai_cpu: list[dict] | None = None, sources: list[Path] | None = None) -> dict:
    """{"device", "fallback": [{op, called_at}], "ai_cpu": [{op, max_us, count}], "note", "advice"}."""
    if kind != "npu":
        return {
            "device": kind,
            "fallback": [],
            "ai_cpu": [],
            "note": WHY_EMPTY.get(kind, WHY_EMPTY["cpu"]),
            "advice": [],
        }
    fb = [{"op": op, "called_at": where_called(op, sources)} for op in fallback_ops(warnings_text)]
    ac = [{"op": o["name"], "max_us": o.get("max_us"), "count": o.get("count")} for o in (ai_cpu or [])]
    note = (
        f"{len(fb)} operator(s) fell back to the CPU, {len(ac)} ran on AI CPU"
        if fb or ac
        else "every operator ran on the AI Core / Vector units (no fallback warning"
        + (
            ", no AI CPU kernel in the profile)"
            if ai_cpu is not None
            else "; AI CPU operators need per-rank kernel data: kernel_details.csv or op_summary)"
        )
    )
    return {"device": kind, "fallback": fb, "ai_cpu": ac, "note": note, "advice": ADVICE if fb or ac else []}


def summary(rep: dict) -> str:
    if not rep["fallback"] and not rep["ai_cpu"]:
        return rep["note"]
    ops = [f["op"] for f in rep["fallback"]] + [a["op"] for a in rep["ai_cpu"]]
    return f"{rep['note']}: {', '.join(ops[:5])}{' …' if len(ops) > 5 else ''}; {rep['advice'][0]}"
