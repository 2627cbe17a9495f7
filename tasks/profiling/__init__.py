"""Profiling: collection (collect.py, msprof.py), readers by header (tables.py, ascend.py, timeline.py,
torch_trace.py, loader.py), the unified report (model.py, report.py, render.py, charts.py), advisor rules
(advisor.py) and the MLflow baseline (baseline.py). The stage entry is tasks/stages/profile.py."""
