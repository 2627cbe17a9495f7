"""Each fact is defined once: a second copy coming back (a class, a formula, a table, a setting) fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE = [p for d in ("tasks", "data_prep", "bench", "dags", "plugins") for p in (REPO / d).rglob("*.py")]


def defined(pattern: str) -> list[str]:
    """Files (relative) whose text matches `pattern` (a definition, not a use)."""
    rx = re.compile(pattern, re.M)
    return sorted(str(p.relative_to(REPO)) for p in CODE if rx.search(p.read_text(encoding="utf-8")))


def test_one_parallel_layout_type_for_planner_and_trainer():
    assert defined(r"^class \w*Layout\b") == ["tasks/layout.py"]  # the MoE planner's too
    from tasks import layout
    from tasks.planner import memory, moe, search

    assert search.Layout is memory.Layout is moe.Layout is layout.Layout
    # The planner's plan row is the Layout itself (plus its figures): the trainer reads it without renaming.
    row = search._row(layout.Layout(pp=2, pp_schedule="interleaved1f1b", virtual_stages=2))
    assert set(layout.Layout.__dataclass_fields__) <= set(row)
    from tasks.model.config import get_preset
    from tasks.planner.cluster import get_cluster

    pb = moe.MoeProblem(get_cluster("cpu-laptop"), get_preset("moe-demo"), 64, 8, tp=2)
    plan = moe.search(pb)["plans"][0]
    assert set(layout.Layout.__dataclass_fields__) <= set(plan) and plan["tp"] * plan["dp"] == pb.cluster.world


def test_one_model_shape_type_for_model_planner_and_config():
    """tasks.shape.TransformerConfig is the model's, the dense and MoE planners' and the config's one shape type; the
    config's model section holds only what the user set (None = unset, no 0/-1 "use the preset" sentinels)."""
    assert defined(r"^class \w*(Shape|TransformerConfig)\b") == ["tasks/shape.py"]
    assert defined(r"VOCAB_FROM_TOKENIZER|\bshape_of\(|_OVERRIDES_SIGNED") == []
    from tasks.config import SHAPE_OVERRIDES, ModelConfig
    from tasks.model import TransformerConfig as model_type
    from tasks.planner import moe, search
    from tasks.shape import PRESETS, TransformerConfig

    assert model_type is TransformerConfig
    assert search.Problem.__dataclass_fields__["shape"].type == "TransformerConfig | None"
    assert moe.MoeProblem.__dataclass_fields__["shape"].type == "TransformerConfig"
    assert set(SHAPE_OVERRIDES) <= set(TransformerConfig.__dataclass_fields__)
    assert all(ModelConfig.model_fields[k].default is None for k in SHAPE_OVERRIDES)
    mc = ModelConfig(preset="qwen2-0.5b", n_layers=2, aux_loss_coef=0.0)  # 0 is a value (loss off), not "unset"
    assert mc.overrides() == {"n_layers": 2, "aux_loss_coef": 0.0}
    want = dataclasses.replace(PRESETS["qwen2-0.5b"], n_layers=2, aux_loss_coef=0.0)
    assert TransformerConfig.from_preset(mc.preset, **mc.overrides()) == want


def test_one_flop_per_token_formula():
    """Defined in planner/memory.py; the planner's step time, the trainer's MFU and the benchmarks call it."""
    assert defined(r"^def flops_per_token\b") == ["tasks/planner/memory.py"]
    assert defined(r"\b6(\.0)?\s*\*\s*\(?\s*(matmul|[a-z_.]*n_params|[a-z_.]*num_params|L\s*\*)") == [
        "tasks/planner/memory.py"
    ]
    from tasks.model import flops_per_token as model_flops
    from tasks.model.config import get_preset
    from tasks.planner.memory import flops_per_token
    from tasks.planner.search import Problem, step_time
    from tasks.planner.cluster import get_cluster
    from tasks.layout import Layout

    tcfg = get_preset("llama3-8b")
    assert model_flops is flops_per_token
    c = get_cluster("h100-80g")
    pb = Problem(c, tcfg, 2048, 64, efficiency=1.0)
    t = step_time(pb, Layout(dp=8, micro_batch=1, microbatches=8))
    assert t["compute_s"] == 64 * 2048 * flops_per_token(tcfg, 2048) / (8 * c.peak_tflops * 1e12)


def test_one_table_of_device_peaks_and_memory():
    """Cluster presets and the trainer's MFU peak read tasks.planner.cluster.DEVICES; no TFLOP/s figure elsewhere."""
    from tasks.planner.cluster import DEVICES, PRESETS, device_peak_tflops

    for name, cluster in PRESETS.items():
        assert (cluster.memory_gb, cluster.peak_tflops) == (DEVICES[name].memory_gb, DEVICES[name].peak_tflops)
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == PRESETS["h100-80g"].peak_tflops
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB") == PRESETS["a100-80g"].peak_tflops
    assert device_peak_tflops("Ascend910B2") == PRESETS["910b"].peak_tflops
    assert device_peak_tflops("Ascend910_9391") == PRESETS["910c"].peak_tflops
    assert device_peak_tflops("Tesla T4") is None
    for figure in ("989", "313", "376"):  # each datasheet peak is written once
        assert defined(rf"\b{figure}\.0\b") == ["tasks/planner/cluster.py"], figure
    assert not defined(r"PEAK_TFLOPS\s*=")


def test_one_memory_unit():
    """Printed memory is decimal (tasks/units.py: GB = 1e9); no other GB/GiB constant or 2**30 divisor."""
    from tasks.units import GB, MB

    assert (GB, MB) == (1e9, 1e6)
    assert defined(r"^\s*(GB|GIB|MB)\s*=") == ["tasks/units.py"]
    assert not defined(r"(/|//)\s*(2\s*\*\*\s*30|1\s*<<\s*30|1024\s*\*\*\s*3|2\s*\*\*\s*20|1\s*<<\s*20)\b")


def test_one_mlflow_ui_url_setting(monkeypatch):
    """tracking.ui_url, $MLFLOW_UI_URL and the default resolve in tasks.tracking.ui_url(); the summary and the link
    plugin print the same address."""
    import sys

    from tasks import tracking
    from tasks.config import load_config

    cfg = load_config()
    monkeypatch.setenv("MLFLOW_UI_URL", "http://env.example:5001/")
    assert tracking.ui_url(cfg) == "http://env.example:5001" and cfg.tracking.ui_url == ""
    assert tracking.run_url("r1", cfg) == "http://env.example:5001/#/runs/r1"
    cfg.tracking.ui_url = "http://cfg.example:5002"
    assert tracking.run_url("r1", cfg, "7") == "http://cfg.example:5002/#/experiments/7/runs/r1?" + tracking.UI_VIEW
    monkeypatch.delenv("MLFLOW_UI_URL")
    monkeypatch.delenv("MLFLOW_PORT", raising=False)
    assert tracking.ui_url(None) == tracking.DEFAULT_UI_URL
    monkeypatch.setenv("MLFLOW_PORT", "5077")  # `make ui MLFLOW_PORT=5077`: the printed links follow the port
    assert tracking.ui_url(None) == "http://127.0.0.1:5077"
    # An `mlflow server` store serves its own UI: the links go there (never its user and password), not to 127.0.0.1
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://u:secret@mlflow.internal:5005/")
    assert tracking.ui_url(None) == "http://mlflow.internal:5005"
    monkeypatch.setenv("MLFLOW_UI_URL", "https://mlflow.example.com")  # a public address set for the UI wins
    assert tracking.ui_url(None) == "https://mlflow.example.com"
    monkeypatch.delenv("MLFLOW_UI_URL")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_PORT")
    sys.path.insert(0, str(REPO / "plugins"))
    try:
        import mlflow_link
    finally:
        sys.path.remove(str(REPO / "plugins"))
    monkeypatch.setenv("MLFLOW_UI_URL", "http://env.example:5001")
    assert mlflow_link.mlflow_run_url("r1") == tracking.run_url("r1", load_config())
    assert "UI_URL" not in (REPO / "plugins" / "mlflow_link.py").read_text().split('"""', 2)[2]
    assert defined(r"127\.0\.0\.1:5000\"") == ["tasks/tracking.py"]


def test_docstrings_cite_public_sources_not_notes_outside_the_repository():
    stale = re.compile(r"ascend-reference\.md|platform-facts|seed guides?|upstream-apis\.md|/work/shared", re.I)
    files = CODE + list((REPO / "tests").rglob("*.py"))
    assert [
        str(p.relative_to(REPO))
        for p in files
        if p.name != "test_one_source.py" and stale.search(p.read_text(encoding="utf-8"))
    ] == []
