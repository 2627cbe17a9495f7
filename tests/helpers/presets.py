"""ci-tiny shortened for the tests that run the whole DAG under a real scheduler to check where things run and what
the operator sees, not what the stages compute (tests/test_celery_cluster.py, tests/test_browser.py): one rank, one
shard per split, fewer smoke steps and tokens. Written as a site preset file ($LLM_PIPELINE_PRESET=<path>)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.dags import preset_file

SHORT = {
    "hardware": {"nproc_per_node": 1},
    "data": {"shard_size_mb": 4.0},  # one shard per split: two write ranges
    "parallel": {"dp": 1, "zero": 0},
    "smoke": {"steps": 6, "window": 3},
    "train": {"steps": 4, "checkpoint_every": 2},
    "quantize": {"calibration_batches": 1, "qat_steps": 2},
    "evaluate": {"agreement_windows": 2, "latency_tokens": 4, "max_new_tokens": 4, "prompts": ["def "]},
}


def short_ci_tiny(path: Path, **extra: dict) -> Path:
    """ci-tiny with SHORT (and `extra`: {section: {key: value}}, replacing SHORT's) applied, written to `path`."""
    return preset_file(path, {**SHORT, **extra})
