"""The whole main DAG through `airflow dags test` on CPU (the ci-tiny preset), read back from MLflow.

One full run is shared by the session's DAG-level tests (the session fixture `checkpoint_run`, tests/conftest.py: run
once, also under xdist; each test reads it only): ci-tiny continuing the training of a tiny Qwen2 saved by
`transformers` with its own tokenizer (`tokenizer` and `hf_path` Params = that directory). The default
path (a BPE trained on the corpus, random init) runs every task of the DAG in tests/test_browser.py (through the
scheduler) and its shard and train tasks in tests/test_orchestration.py."""

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from tasks.stages import STAGES
from tests.helpers.dags import LEAN, NO_PROBE, dags_test, preset_file, shared_failing_rehearsal_run

os.environ["HF_HUB_OFFLINE"] = "1"


REPO = Path(__file__).resolve().parent.parent


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _nll(model, batches) -> float:
    """Mean next-token NLL of `batches` under a transformers model (fp32)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            logits = model(inputs).logits.float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            n += targets.numel()
    return total / n


@pytest.mark.slow
def test_dags_test_runs_every_stage(checkpoint_run):
    import mlflow

    tmp_path, out = checkpoint_run.tmp, checkpoint_run.out
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]

    run_dirs = list((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    assert len(run_dirs) == 1
    results = {s: json.loads((run_dirs[0] / f"{s}.json").read_text()) for s in STAGES}
    assert all(r["status"] in ("ok", "warn") for r in results.values()), {s: r["summary"] for s, r in results.items()}

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    parents = client.search_runs([exp.experiment_id], "tags.`pipeline.kind` = 'parent'")
    assert len(parents) == 1
    assert parents[0].info.status == "FINISHED" and parents[0].data.tags["pipeline.outcome"] == "success"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(c.data.tags["pipeline.stage"] for c in children) == sorted(STAGES)
    assert {c.info.run_id for c in children} == {r["mlflow_run_id"] for r in results.values()}
    assert "Evaluation & registry" in log  # the summary table was printed


@pytest.mark.slow
def test_dag_continues_training_a_checkpoint_with_its_own_tokenizer(checkpoint_run):
    """Continued training from a pretrained checkpoint uses the checkpoint's own tokenizer end to end: the shard
    set, the starting weights, the HF export, quantize and evaluate all carry them."""
    import transformers
    from data_prep.loader import ShardLoader
    from data_prep.manifest import digest
    from tasks.config import load_config
    from tasks.quant import inputs

    run = checkpoint_run
    tmp_path, out, ckpt, hf, fast = run.tmp, run.out, run.ckpt, run.hf, run.fast
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    run_dir = next((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    res = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in ("shard", "train", "quantize", "evaluate")}

    # Shard: the checkpoint's tokenizer, byte for byte, and its vocabulary.
    shard_dir = Path(res["shard"]["shard_dir"])
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["tokenizer"]["source"] == str((ckpt / "tokenizer.json").resolve())
    assert manifest["tokenizer"]["sha256"] == _sha(ckpt / "tokenizer.json") == _sha(shard_dir / "tokenizer.json")
    assert manifest["vocab_size"] == len(fast) == hf.config.vocab_size
    assert manifest["eos_id"] == fast.eos_token_id

    # Train: step 1's loss is the checkpoint's own loss on step 1's global batch (same weights, same tokens).
    tiny = load_config("ci-tiny")
    loader = ShardLoader(
        shard_dir,
        "train",
        batch_size=tiny.train.global_batch,
        dp_rank=0,
        dp_world=1,
        num_workers=0,
        seed=tiny.train.seed,
    )
    first = next(iter(loader))
    step1 = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert step1["step"] == 1
    assert step1["loss"] == pytest.approx(_nll(hf, [first]), abs=1e-4)
    # From a trained checkpoint four steps barely move the loss (batch-to-batch noise is larger); it stays a trained
    # model's, far below ln(vocab).
    assert res["train"]["steps"] == 4 and res["train"]["final_loss"] < 0.8 * math.log(len(fast))

    # Export: transformers loads it, with the checkpoint's tokenizer files (not a tokenizer of the project's).
    export = Path(res["train"]["hf_dir"])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # all transformers wrote (no special_tokens_map.json)
        assert _sha(export / name) == _sha(ckpt / name), name
    back = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(export)
    assert back_tok.get_vocab() == fast.get_vocab() and back_tok.eos_token == fast.eos_token
    assert back.config.vocab_size == hf.config.vocab_size
    assert back.config.eos_token_id == hf.config.eos_token_id == fast.eos_token_id  # the checkpoint's, not Qwen2's
    assert not torch.equal(back.model.layers[0].mlp.down_proj.weight, hf.model.layers[0].mlp.down_proj.weight)

    # Quantize and evaluate: that export, calibrated and measured on the checkpoint tokenizer's shard set.
    meta = json.loads((run_dir / "quantize" / "quant_meta.json").read_text())
    assert meta["model_dir"] == str(export) and meta["data_digest"] == digest(shard_dir)
    assert res["quantize"]["model_dir"] == res["evaluate"]["model_dir"] == str(export)
    assert res["evaluate"]["quant_dir"] == res["quantize"]["quant_dir"]  # the model quantize handed on
    if "qat" in res["quantize"]["gate"]:  # PTQ missed the gate: QAT of that model, in quantize
        assert res["evaluate"]["quant_dir"] == str(run_dir / "quantize_qat")
    assert res["evaluate"]["data_digest"] == digest(shard_dir)
    comparison = json.loads((run_dir / "evaluate" / "comparison.json").read_text())
    batches = inputs.val_batches(shard_dir, tiny.evaluate.eval_batches, tiny.train.micro_batch, "evaluation")
    assert comparison["metrics"]["fp_nll"] == pytest.approx(_nll(back, batches), abs=1e-4)


@pytest.mark.slow
def test_dags_test_runs_moe_demo_with_expert_parallelism(tmp_path, airflow_db):
    """The whole DAG on the MoE preset with ep 2 (the issue's `make run CONF='{"model_preset": "moe-demo", "ep": 2}'`,
    on ci-tiny's small data, 2 steps): every stage handles the mixture of experts — the MoE planner hands ep to
    training, training runs dp2·ep2 and logs the load-balancing loss to MLflow, the profile counts the all-to-alls
    as communication and evaluates the expert-imbalance rule on the router statistics, quantization puts every
    layer's experts in INT8 weight-only, and evaluation gates and registers that model."""
    import mlflow
    from tasks.quant.artifact import WEIGHTS, load_quantized

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    # ci-tiny, its evaluation task and validation smaller, no collective probe (the MoE claims are in later stages)
    preset = preset_file(tmp_path / "ci-tiny-lean.yaml", LEAN | {"hardware": NO_PROBE})
    steps = 2  # ci-tiny's 6 made shorter: every step's records are checked, none needs a longer run
    conf = {"model_preset": "moe-demo", "ep": 2, "steps": steps}
    out = dags_test("llm_pipeline", conf, tmp_path, extra_env={"LLM_PIPELINE_PRESET": str(preset)}, timeout=1200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    [run_dir] = list((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    results = {s: json.loads((run_dir / f"{s}.json").read_text()) for s in STAGES}
    assert all(r["status"] in ("ok", "warn") for r in results.values()), {s: r["summary"] for s, r in results.items()}

    plan = json.loads((run_dir / "plan" / "plan.json").read_text())
    assert plan["moe"] is True and results["plan"]["parallel"]["ep"] == 2  # the MoE planner sized it
    assert results["train"]["layout"] == "dp2·ep2"
    assert "layout dp2·ep2 coords" in (run_dir / "logs" / "rank-1.log").read_text()
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(sum(r["moe_tokens_per_expert"]["0"]) == 4 * 64 * 2 for r in records)  # global batch × seq × top-2

    client = mlflow.MlflowClient(uri)
    train_run = client.get_run(results["train"]["mlflow_run_id"])
    moe_metrics = {"train.moe_aux_loss", "train.moe_load_max_over_mean", "train.moe_dropped_frac"}
    assert moe_metrics <= set(train_run.data.metrics)  # the load-balancing loss reached MLflow
    history = client.get_metric_history(train_run.info.run_id, "train.moe_aux_loss")
    assert [m.step for m in history] == list(range(1, steps + 1))

    profile = json.loads((run_dir / "profile" / "report.json").read_text())
    assert profile["step"]["all_to_all_us_per_step"] > 0 and results["profile"]["all_to_all_share"] > 0
    assert profile["moe"]["steps"] >= 1 and sorted(profile["moe"]["by_layer_max_over_mean"]) == ["0", "1", "2", "3"]
    assert results["profile"]["moe_load_max_over_mean"] == pytest.approx(profile["moe"]["max_over_mean"], abs=1e-3)
    assert "profile.all_to_all_share" in client.get_run(results["profile"]["mlflow_run_id"]).data.metrics

    quant_dir = Path(results["quantize"]["quant_dir"])
    meta = json.loads((quant_dir / "quant_meta.json").read_text())
    experts = [f"layers.{i}.moe.experts" for i in range(4)]
    assert set(experts) <= set(meta["quantized_layers"]) and meta["layer_types"][experts[0]] == "GroupedExperts"
    assert (quant_dir / WEIGHTS).stat().st_size < 0.5 * meta["fp32_bytes"]
    ev = results["evaluate"]
    for gated in {quant_dir, Path(ev["quant_dir"])}:  # PTQ's model, and QAT's if PTQ missed the gate
        model = load_quantized(gated)
        for name in experts:
            for w in ("w1", "w2", "w3"):
                t = model.get_submodule(name).get_parameter(w)
                assert type(t).__module__.startswith("torchao") and t.qdata.dtype == torch.int8, (gated, name, w)
    assert ev["passed"] and ev.get("version"), ev  # gated, then registered
    assert client.get_model_version(ev["registered_model"], ev["version"]).status == "READY"


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory, airflow_db):
    """The session's llm_pipeline run that fails at train (tests/helpers/dags.py FAILING: the rehearsal measures more
    than the device holds), shared with test_real_size_route. A missing corpus failing the shard stage is checked at
    DAG level by test_orchestration's llm_data run."""
    return shared_failing_rehearsal_run(tmp_path_factory)


@pytest.mark.slow
def test_failed_stage_stops_the_run_and_notifies_its_cause(failing_run):
    var, out = failing_run.tmp / "var", failing_run.out
    run_dir = next((var / "runs" / "llm_pipeline").iterdir())
    train = json.loads((run_dir / "train.json").read_text())
    assert train["status"] == "failed" and train["error"] and "\n" not in train["error"], train
    assert not (run_dir / "profile.json").exists()  # nothing downstream of a failed stage ran
    notes = [json.loads(line) for line in (var / "notifications.jsonl").read_text().splitlines()]
    assert [(n["stage"], n["cause"]) for n in notes] == [("train", train["error"])]
    assert "Evaluation & registry" in out.stdout + out.stderr  # the summary still printed
