"""Unsupported / fallback operator report: torch_npu's fallback warnings (exact text from Ascend/pytorch issues),
AI CPU operators from a profile, where the model code calls them; on CPU/CUDA an empty list with the reason."""

from tasks.model import op_support

# As torch_npu prints it (Ascend/pytorch#40, opendatalab/MinerU#1695).
WARN_ISIN = (
    "CAUTION: The operator 'aten::isin.Tensor_Tensor_out' is not currently supported on the NPU backend and "
    "will fall back to run on the CPU. This may have performance implications. (function npu_cpu_fallback)"
)
WARN_NMS = WARN_ISIN.replace("aten::isin.Tensor_Tensor_out", "torchvision::nms")


def test_fallback_ops_are_listed_once_with_their_call_sites(tmp_path):
    src = tmp_path / "model.py"
    src.write_text("import torch\n\ndef mask(ids, stop):\n    return torch.isin(ids, stop)\n# isin( in a comment\n")
    rep = op_support.report("npu", [WARN_ISIN, "unrelated", WARN_NMS, WARN_ISIN], sources=[src])
    assert [f["op"] for f in rep["fallback"]] == ["aten::isin.Tensor_Tensor_out", "torchvision::nms"]
    assert rep["fallback"][0]["called_at"] == ["model.py:4"] and rep["fallback"][1]["called_at"] == []
    assert "2 operator(s) fell back to the CPU" in op_support.summary(rep) and rep["advice"]


def test_ai_cpu_ops_from_the_profile_are_named():
    rep = op_support.report("npu", [], ai_cpu=[{"name": "IndexPut", "max_us": 84.0, "count": 12}])
    assert rep["ai_cpu"] == [{"op": "IndexPut", "max_us": 84.0, "count": 12}] and "1 ran on AI CPU" in rep["note"]
    clean = op_support.report("npu", [], ai_cpu=[])
    assert clean["fallback"] == clean["ai_cpu"] == [] and "no AI CPU kernel in the profile" in clean["note"]


def test_cpu_and_cuda_list_nothing_and_say_why():
    for kind in ("cpu", "cuda"):
        rep = op_support.report(kind, [WARN_ISIN])
        assert rep["fallback"] == [] and rep["ai_cpu"] == [] and rep["note"].startswith(f"{kind}:")
        assert "nothing to list" in op_support.summary(rep)


def _line_of(text: str) -> str:
    """`transformer.py:N` of the model's own line calling `text` (found, not hard-coded: the file moves on)."""
    from pathlib import Path

    import tasks.model.transformer as t

    lines = Path(t.__file__).read_text().splitlines()
    return f"transformer.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def test_the_project_model_calls_are_found():
    assert _line_of("F.scaled_dot_product_attention(") in op_support.where_called(
        "aten::_scaled_dot_product_attention.default"
    )
    assert _line_of("torch.rsqrt(") in op_support.where_called("aten::rsqrt.out")
