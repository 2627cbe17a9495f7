"""The real targets in configs/ (docs/real-size.md): on this CPU host each validates, plans feasibly through
`python -m tasks plan --config NAME`, derives its smoke sibling, and renders its Kubernetes Jobs with the guides'
environment values."""

from __future__ import annotations

import json

import pytest
import yaml

from tasks.launch import k8s_job
from tasks.cli import main as cli_main
from tasks.config import load_config, validate
from tasks.device import Backend, launch_env
from tasks.launch.placement import MULTI_NODE_STAGES
from tasks.model import from_pipeline, num_params
from tasks.model.sibling import budget_of, choose, estimator
from tests.helpers.k8s_schema import validate as validate_manifest

# preset → (world size, a check of the planner's layout family on the chosen plan)
PRESETS = {
    "qwen2-7b-910b": (8, lambda p: p["pp"] == 1 and p["zero"] in (2, 3)),
    "llama3-8b-910b-2node": (16, lambda p: p["tp"] <= 8 and p["zero"] in (1, 2, 3)),
    "llama3-70b-910c": (128, lambda p: p["tp"] <= 16 and p["tp"] * p["pp"] > 1 and p["zero"] in (1, 2)),
    "qwen2-57b-a14b-910b": (32, lambda p: p["ep"] > 1 and p["tp"] == p["pp"] == 1),
    "llama3-8b-h100": (8, lambda p: p["pp"] == 1 and p["zero"] in (2, 3)),
}
GUIDE_ENV = {"TASK_QUEUE_ENABLE": "2", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_plans_derives_its_sibling_and_renders_its_jobs(name, tmp_path, capsys, monkeypatch):
    world, family = PRESETS[name]
    cfg = validate(load_config(name))
    hw = cfg.hardware
    assert hw.nnodes * hw.nproc_per_node == world

    # Plans feasibly, as a user types it.
    assert cli_main(["plan", "--config", name, "--run-dir", str(tmp_path / "run"), "--no-tracking", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["status"] == "ok" and plan["feasible"] > 0, plan["summary"]
    chosen = {"ep": 1, **plan["parallel"]}
    assert chosen["dp"] * chosen["tp"] * chosen["pp"] == world and family(chosen), chosen
    assert plan["best"]["total_bytes"] <= budget_of(cfg).device_bytes

    # Derives its smoke sibling: the published model does not fit one device in FP32 AdamW, the sibling does.
    full = from_pipeline(cfg, vocab_size=cfg.data.vocab_size)
    sib, info = choose(cfg, full, cfg.data.vocab_size, cfg.data.seq_len)
    assert info["derived_from"] == cfg.model.preset and "does not fit one device" in info["why"]
    assert num_params(sib) <= cfg.smoke.max_params < num_params(full)
    assert estimator(cfg, cfg.data.seq_len)(sib) <= budget_of(cfg).usable_bytes

    # Renders its Kubernetes Jobs; the pods read the preset's own config, and the workers get the guides' values.
    for stage in ("smoke", "train"):
        job_name = k8s_job.job_name("llm_pipeline", "manual__1", 1, stage)
        manifests = k8s_job.render(cfg, tmp_path / "run", job_name, stage)
        for m in manifests:
            validate_manifest(m)
        job = manifests[-1]
        pods = hw.nnodes if stage in MULTI_NODE_STAGES else 1
        assert job["spec"]["parallelism"] == pods
        container = job["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HCCL_CONNECT_TIMEOUT"] == str(hw.hccl_connect_timeout)
        assert env["HCCL_EXEC_TIMEOUT"] == str(hw.hccl_exec_timeout)
        pod_cfg = yaml.safe_load((tmp_path / "run" / "k8s" / f"{job_name}.yaml").read_text())
        assert pod_cfg["hardware"] == {**cfg.to_dict()["hardware"]} and pod_cfg["model"]["preset"] == cfg.model.preset
        assert k8s_job.devices_of(container) == (hw.nproc_per_node if stage in MULTI_NODE_STAGES else 1)
    for var in (*GUIDE_ENV, "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "ASCEND_GLOBAL_LOG_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    env = launch_env(Backend(hw.device, "hccl" if hw.device == "npu" else "nccl", hw.nproc_per_node), hw)
    if hw.device == "npu":
        assert env == {
            **GUIDE_ENV,
            "HCCL_CONNECT_TIMEOUT": str(hw.hccl_connect_timeout),
            "HCCL_EXEC_TIMEOUT": str(hw.hccl_exec_timeout),
            "ASCEND_GLOBAL_LOG_LEVEL": "3",
        }
        assert cfg.train.timeout_s > hw.hccl_exec_timeout >= 1836
        assert hw.hccl_connect_timeout >= 1200
    assert hw.bind_cpus


def test_cuda_preset_jobs_request_gpus(tmp_path):
    cfg = load_config("llama3-8b-h100")
    pod = k8s_job.render(cfg, tmp_path, "llm-x", "train")[-1]["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": 8} and resources["requests"]["nvidia.com/gpu"] == 8
    mounts = {v["name"] for v in pod["volumes"]} | {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert not mounts & set(k8s_job.ASCEND_MOUNTS)  # no Ascend driver paths on a GPU node
