"""The plan stage: config pins, what-if flags, MLflow artifacts, the CLI, and the estimator against real autograd."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from tasks.errors import ConfigError, StageError
from tasks.fsutil import read_json
from tasks.runner import run_stage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Qwen2-0.5B's config.json, the parts the planner reads.
QWEN2_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}


def plan_args(*argv: str) -> argparse.Namespace:
    from tasks.stages.plan import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_pinned_demo_plan_is_logged_to_mlflow(cfg, tmp_path):
    import mlflow

    result = run_stage("plan", cfg, tmp_path)
    assert result["status"] == "ok" and result["pinned"] is True
    assert result["parallel"] == {
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "zero": 3,
        "recompute": "none",
        "pp_schedule": "1f1b",
        "microbatches": 1,
        "micro_batch": 8,
        "virtual_stages": 1,
        "sequence_parallel": False,
    }
    assert result["summary"].startswith("pinned dp2 tp1 pp1 zero3")
    saved = read_json(result["plan_json"])
    assert saved["pinned"] and saved["chosen"]["total_bytes"] == result["best"]["total_bytes"]
    assert len(saved["plans"]) == result["feasible"] > 1  # the alternatives stay ranked, for the table and train
    table = open(result["table"]).read()
    assert "pinned by the config (parallel.dp/tp/pp): fits" in table and "alternatives:" in table
    client = mlflow.MlflowClient(cfg.tracking.uri)
    assert {a.path for a in client.list_artifacts(result["mlflow_run_id"])} >= {"plan.json", "plan_table.txt"}
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.params["plan.dp"] == "2" and run.data.metrics["plan.feasible"] == result["feasible"]


def test_cluster_preset_that_does_not_match_the_device_warns(cfg, tmp_path):
    cfg.tracking.enabled = False
    cfg.hardware.device = "npu"
    result = run_stage("plan", cfg, tmp_path)
    assert result["status"] == "warn"
    assert result["summary"].startswith("hardware.device is npu but hardware.cluster cpu-laptop describes cpu")


def test_pinned_layout_over_memory_warns(cfg, tmp_path):
    cfg.tracking.enabled = False
    cfg.hardware.device_memory_gb = 0.001
    result = run_stage("plan", cfg, tmp_path)
    assert result["status"] == "warn" and result["parallel"]["dp"] == 2
    # The demo model's tensors (~0.05 GB) + the CPU runtime reserve (0.12 GB, tasks.planner.cluster.RESERVE_GB).
    assert "needs 0.2 GB > 0.001 GB" in result["summary"] and "may run out of memory" in result["summary"]


def test_unpinned_plan_chooses_the_layout(cfg, tmp_path):
    cfg.tracking.enabled = False
    cfg.parallel.dp = cfg.parallel.tp = cfg.parallel.pp = 0
    result = run_stage("plan", cfg, tmp_path)
    par, saved = result["parallel"], read_json(result["plan_json"])
    assert result["pinned"] is False and par["dp"] * par["tp"] * par["pp"] == 2  # 2 CPU processes
    best = saved["plans"][0]
    assert {k: best[k] for k in ("dp", "tp", "pp", "zero", "micro_batch")} == {
        k: par[k] for k in ("dp", "tp", "pp", "zero", "micro_batch")
    }
    assert par["micro_batch"] * par["microbatches"] * par["dp"] == cfg.train.global_batch


def test_what_if_flags_ignore_the_config_pins(cfg, tmp_path):
    cfg.tracking.enabled = False
    args = plan_args("--model", "llama3-8b", "--cluster", "910b", "--seq-len", "4096", "--global-batch", "32")
    result = run_stage("plan", cfg, tmp_path, args=args)
    par = result["parallel"]
    assert result["pinned"] is False and par["dp"] * par["tp"] * par["pp"] == 8
    assert result["best"]["reserve_bytes"] == 5e9  # CANN/HCCL reserve of the NPU preset
    assert "llama3-8b (8.03B params" in read_json(result["plan_json"])["model"]


@pytest.mark.parametrize(
    "argv, source",
    [
        (["--model", "llama3-8b", "--cluster", "910b"], "(seq and global batch from the config: --seq-len and"),
        (["--model", "llama3-8b", "--cluster", "910b", "--seq-len", "4096"], "(global batch from the config: --glo"),
        (["--model", "moe-demo", "--global-batch", "8"], "training: seq 128, global batch 8 (seq from the config: "),
        (["--model", "llama3-8b", "--cluster", "910b", "--seq-len", "4096", "--global-batch", "32"], None),
        ([], None),  # the config's own plan: its own training settings
    ],
)
def test_a_what_if_plan_says_which_training_settings_are_the_configs(cfg, tmp_path, argv, source):
    """A what-if plan of a 70B model on the CPU demo's 128-token batches is not the plan a user means: the table's
    training line says which of seq and global batch came from the config, and the flags that set them."""
    cfg.tracking.enabled = False
    run_stage("plan", cfg, tmp_path, args=plan_args(*argv))
    training = next(ln for ln in (tmp_path / "plan" / "plan_table.txt").read_text().splitlines() if "training:" in ln)
    if source is None:
        assert "from the config" not in training, training
    else:
        assert source in training, training


def test_hf_config_and_explicit_shape(cfg, tmp_path):
    cfg.tracking.enabled = False
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_0_5B))
    result = run_stage("plan", cfg, tmp_path / "a", args=plan_args("--hf-config", str(tmp_path)))
    assert "(494.03M params" in read_json(result["plan_json"])["model"]  # Qwen2-0.5B's published 494,032,768
    from tasks.stages.plan import _count

    assert [_count(n) for n in (139584, 999, 13e9)] == ["139.58K", "999", "13.00B"]  # not "139584.00"
    args = plan_args("--hidden", "256", "--layers", "6", "--heads", "8", "--vocab", "4096", "--ffn", "512")
    model = read_json(run_stage("plan", cfg, tmp_path / "b", args=args)["plan_json"])["model"]
    assert model.startswith("custom (") and "h 256, L 6, heads 8/8 kv, ffn 512, vocab 4096" in model


def test_a_partial_architecture_takes_the_family_rule_not_the_config_preset(cfg, tmp_path):
    """--hidden/--layers/--heads alone once planned a 14.9B model with the demo preset's ffn 384, called "demo"."""
    from tasks.model.config import PRESETS, num_params

    cfg.tracking.enabled = False
    what_if = ("--cluster", "910b", "--nodes", "8")
    args = plan_args("--hidden", "8192", "--layers", "80", "--heads", "64", *what_if)
    model = read_json(run_stage("plan", cfg, tmp_path / "a", args=args)["plan_json"])["model"]
    published = num_params(PRESETS["llama3-70b"])  # the llama3 rule rebuilds Llama-3-70B exactly
    assert model.startswith(
        f"custom ({published / 1e9:.2f}B params, h 8192, L 80, heads 64/8 kv, ffn 28672, vocab 128256; llama3 rule"
    )
    args = plan_args("--hidden", "5120", "--layers", "40", "--heads", "40", "--family", "llama2", *what_if)
    model = read_json(run_stage("plan", cfg, tmp_path / "b", args=args)["plan_json"])["model"]
    assert "heads 40/40 kv, ffn 13824, vocab 32000; llama2 rule" in model  # Llama-2-13B's published sizes
    args = plan_args("--model", "llama3-70b", "--layers", "40", *what_if)
    model = read_json(run_stage("plan", cfg, tmp_path / "c", args=args)["plan_json"])["model"]
    assert model.startswith("custom (") and "L 40" in model and model.endswith("; from llama3-70b)")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (("--hidden", "8192", "--layers", "80"), "--heads: a custom architecture needs --hidden, --layers and --heads"),
        (
            ("--hidden", "896", "--layers", "24", "--heads", "14", "--family", "qwen2"),
            "--ffn, --kv-heads: a custom qwen2 model needs them",
        ),
        (("--hidden", "896", "--layers", "24", "--heads", "14"), "--heads 14: the llama3 rule's 8 KV heads"),
        (("--model", "llama3-8b", "--family", "llama2"), "--family: only for a custom architecture"),
        (
            ("--params", "7e9", "--model", "llama3-8b", "--layers", "40"),
            "--params: a bare parameter count, not with --model, --layers; give one or the other",
        ),
        (  # no shape, no activations: the value was dropped, every row said "recompute none"
            ("--params", "7e9", "--cluster", "910b", "--nodes", "1", "--recompute", "full"),
            "--recompute full: a plan from --params alone sizes model states only (no layer shape, no activations)",
        ),
        (
            ("--params", "13e9", "--device-memory-gb", "64"),
            "--device-memory-gb 64 without --cluster would keep the cpu-laptop preset's other facts (0.037 TFLOP/s",
        ),
    ],
)
def test_underspecified_what_ifs_are_refused_in_one_line(cfg, tmp_path, argv, needle):
    cfg.tracking.enabled = False
    with pytest.raises(StageError) as err:
        run_stage("plan", cfg, tmp_path, args=plan_args(*argv))
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)


def test_a_failed_rerun_keeps_the_finished_result_it_replaces(cfg, tmp_path):
    """The runner's failure record of a rerun keeps the stage's last finished result (`previous`), through further
    failures: a refused rerun in a finished run directory loses no completed record."""
    cfg.tracking.enabled = False
    done = run_stage("plan", cfg, tmp_path, args=plan_args())
    for _ in range(2):
        with pytest.raises(StageError):
            run_stage("plan", cfg, tmp_path, args=plan_args("--hidden", "8192", "--layers", "80"))
        record = read_json(tmp_path / "plan.json")
        assert record["status"] == "failed" and record["previous"] == done


def test_llama_ffn_rule_gives_the_published_sizes():
    from tasks.planner.families import llama_ffn

    assert [llama_ffn(h, 256) for h in (4096, 5120)] == [11008, 13824]  # Llama-2-7B, 13B
    assert [llama_ffn(h, 1024, 1.3) for h in (4096, 8192)] == [14336, 28672]  # Llama-3-8B, 70B
    assert llama_ffn(16384, 4096, 1.2) == 53248  # Llama-3.1-405B's own params


def test_device_memory_on_the_configs_own_explicit_cluster_is_a_what_if(tmp_path):
    from tasks.config import load_config

    c = load_config(sets=["hardware.cluster=cpu-laptop", "tracking.enabled=false"])
    result = run_stage("plan", c, tmp_path, args=plan_args("--device-memory-gb", "16"))
    assert read_json(result["plan_json"])["cluster"]["memory_gb"] == 16


def test_infeasible_plan_fails_with_the_reason_and_keeps_the_table(cfg, tmp_path):
    cfg.tracking.enabled = False
    args = plan_args(
        "--params", "13e9", "--cluster", "910b", "--nodes", "1", "--devices-per-node", "1", "--device-memory-gb", "64"
    )
    with pytest.raises(StageError, match=r"needs 239\.0 GB > 64 GB") as err:  # 234 GB of training states + 5 GB CANN
        run_stage("plan", cfg, tmp_path, args=args)
    assert "\n" not in str(err.value)
    saved = read_json(tmp_path / "plan" / "plan.json")
    assert saved["plans"] == [] and saved["rejected"][0]["total_bytes"] == 234e9 + 5e9


def test_cli_13b_on_one_card_subprocess(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "tasks",
        "plan",
        "--no-tracking",
        "--run-dir",
        str(tmp_path),
        "--params",
        "13e9",
        "--cluster",
        "910b",
        "--nodes",
        "1",
        "--devices-per-node",
        "1",
        "--device-memory-gb",
        "64",
        "--json",
    ]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "no feasible plan for 13.00B params" in proc.stderr and "needs 239.0 GB > 64 GB" in proc.stderr
    failed = json.loads(proc.stdout)  # --json: the failure record on stdout too
    assert failed["status"] == "failed" and failed["error"] == proc.stderr.strip().removeprefix("error: ")


def test_cli_70b_json(tmp_path, capsys):
    from tasks.cli import main

    rc = main(
        [
            "plan",
            "--no-tracking",
            "--run-dir",
            str(tmp_path),
            "--model",
            "llama3-70b",
            "--cluster",
            "910b",
            "--nodes",
            "8",
            "--seq-len",
            "4096",
            "--global-batch",
            "64",
            "--tp",
            "8",
            "--pp",
            "8",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["parallel"]["tp"], result["parallel"]["pp"]) == (8, 8)
    assert result["best"]["total_bytes"] <= 64e9
    assert "pinned {'tp': 8, 'pp': 8}" in (tmp_path / "plan" / "plan_table.txt").read_text()


def test_estimate_for_run_against_autograd_saved_tensors():
    """Calibration on the real model: the estimate of what autograd keeps, against the bytes it does keep."""
    import torch

    from tasks.model import build_model, get_preset, materialize
    from tasks.model.loss import lm_loss
    from tasks.planner import estimate_for_run
    from tasks.planner.calibrate import saved_activation_bytes
    from tasks.layout import Layout
    from tasks.planner.memory import estimate, num_params

    tcfg = get_preset("demo")
    model = materialize(build_model(tcfg), "cpu")
    tokens = torch.randint(0, tcfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    measured = saved_activation_bytes(model, tokens, lm_loss)
    est = estimate(tcfg, 128, Layout(micro_batch=4, flash_attention=True), "fp32")
    assert 0.75 < est["activations_bytes"] / measured < 1.25  # 0.93 when written
    # The unfused formula counts s×s scores the fused SDPA never keeps.
    unfused = estimate(tcfg, 128, Layout(micro_batch=4, flash_attention=False), "fp32")
    assert unfused["activations_bytes"] > est["activations_bytes"]
    total = estimate_for_run(tcfg, 128, 4, precision="fp32")
    assert total == int(est["total_bytes"])
    assert total == pytest.approx(est["activations_bytes"] + 16 * num_params(tcfg))


def plan_of(tmp_path, config: str, *argv: str, sets=()) -> dict:
    """The plan stage of a preset with --set values (cfg.explicit) and plan flags, without MLflow."""
    from tasks.config import load_config

    c = load_config(config, sets=sets)
    c.tracking.enabled = False
    return run_stage("plan", c, tmp_path, args=plan_args(*argv))


def test_explicit_zero_recompute_micro_batch_and_schedule_are_planned_not_searched(tmp_path):
    """--set parallel.zero=3 (recompute, micro-batch, schedule) with dp/tp/pp left to the planner: training keeps the
    value (tasks.layout.resolve), so the plan sizes only that value; it once searched them all and chose another."""
    default = plan_of(tmp_path / "default", "qwen2-7b-910b")["parallel"]
    for i, (key, value) in enumerate([("parallel.zero", 3), ("parallel.recompute", "full"), ("train.micro_batch", 2)]):
        field = key.partition(".")[2]
        assert default[field] != value  # the plan's own choice is another
        result = plan_of(tmp_path / str(i), "qwen2-7b-910b", sets=[f"{key}={value}"])
        assert result["parallel"][field] == value, key
        assert {p[field] for p in read_json(result["plan_json"])["plans"]} == {value}, key
    saved = read_json(plan_of(tmp_path / "s", "qwen2-7b-910b", sets=["parallel.pp_schedule=gpipe"])["plan_json"])
    pipelined = saved["plans"] + [r for r in saved["rejected"] if "pp_schedule" in r]
    assert {p["pp_schedule"] for p in pipelined if p["pp"] > 1} == {"gpipe"}  # the preset's plan.schedules: 1f1b


def test_train_keeps_an_explicit_layout_value_and_takes_the_plans_for_the_rest(tmp_path):
    """A plan made before `--set parallel.zero=3 train.micro_batch=2` (the DAG's Params, a rerun): resolve keeps the
    explicit values; the preset's own (zero 3 by default, recompute selective) are still the plan's."""
    from tasks.config import load_config
    from tasks.layout import resolve

    plan = plan_of(tmp_path, "qwen2-7b-910b", "--recompute", "none")
    chosen = plan["parallel"]
    assert (chosen["zero"], chosen["micro_batch"], chosen["recompute"]) == (2, 1, "none")
    lay = resolve(load_config("qwen2-7b-910b", sets=["parallel.zero=3", "train.micro_batch=2"]), plan, 8)
    assert (lay.zero, lay.micro_batch, lay.recompute, lay.dp, lay.pp) == (3, 2, "none", chosen["dp"], chosen["pp"])
    lay = resolve(load_config("qwen2-7b-910b"), plan, 8)  # nothing explicit: the plan's layout
    assert (lay.zero, lay.micro_batch, lay.recompute) == (2, 1, "none")


@pytest.mark.parametrize("how", [("--optimizer", "sgd"), ("train.optimizer=sgd",)])
@pytest.mark.parametrize("config", ["qwen2-7b-910b", "qwen2-57b-a14b-910b"])
def test_the_optimizer_sizes_the_plan_from_the_flag_or_the_config(tmp_path, config, how):
    """train.optimizer=sgd once left the plan sizing AdamW's states (the flag defaulted to adamw); the MoE plan
    ignored --optimizer too."""
    argv, sets = (how, ()) if how[0].startswith("--") else ((), how)
    adamw = plan_of(tmp_path / "adamw", config)["best"]["optimizer_bytes"]
    sgd = plan_of(tmp_path / "sgd", config, *argv, sets=sets)["best"]["optimizer_bytes"]
    assert sgd < 0.7 * adamw  # SGD's momentum against AdamW's two moments (7B: 7.6 → 3.8 GB; 57B MoE: 21.5 → 14.4)


@pytest.mark.parametrize(
    "argv, sets, field, value",
    [
        (("--micro-batch", "1"), (), "micro_batch", 1),  # its own plan: mb 2
        ((), ("train.micro_batch=1",), "micro_batch", 1),
        (("--zero", "2"), (), "zero", 2),  # its plan.zero_stages: [3]
        ((), ("parallel.zero=2",), "zero", 2),
    ],
)
def test_the_moe_plan_takes_the_flags_and_explicit_keys(tmp_path, argv, sets, field, value):
    """The mixture-of-experts planner once ignored --zero, --micro-batch and their keys and planned its own."""
    result = plan_of(tmp_path, "qwen2-57b-a14b-910b", *argv, sets=sets)
    assert result["parallel"][field] == value
    saved = read_json(result["plan_json"])
    assert {p[field] for p in saved["plans"] + saved["rejected"] if field in p} == {value}


@pytest.mark.parametrize("argv, sets", [(("--zero", "1"), ()), ((), ("parallel.zero=1",))])
def test_the_moe_plan_sizes_a_zero_that_does_not_fit(tmp_path, argv, sets):
    """ZeRO 1 keeps the 57B's parameters whole on every device: no plan, where ZeRO 3 (its plan.zero_stages) fits."""
    with pytest.raises(StageError, match=r"no feasible plan for qwen2-57b-a14b .* closest needs 71\.0 GB > 64 GB"):
        plan_of(tmp_path, "qwen2-57b-a14b-910b", *argv, sets=sets)
    assert {r["zero"] for r in read_json(tmp_path / "plan" / "plan.json")["rejected"] if "zero" in r} == {1}


def test_an_explicit_ep_1_is_what_the_moe_plan_sizes(tmp_path):
    """--set parallel.ep=1 (the DAG's EP Param at 1): training keeps it (tasks.layout.EXPLICIT_LAYOUT), but the plan
    pinned only ep > 1 and sized another ep's memory for a run that would not use it."""
    assert plan_of(tmp_path / "default", "qwen2-57b-a14b-910b", "--zero", "3")["parallel"]["ep"] > 1
    assert (
        plan_of(tmp_path / "ep1", "qwen2-57b-a14b-910b", "--zero", "3", sets=["parallel.ep=1"])["parallel"]["ep"] == 1
    )


@pytest.mark.parametrize(
    "argv, sets, needle",
    [
        (("--recompute", "selective"), (), "--recompute selective: the mixture-of-experts planner sizes recompute"),
        ((), ("parallel.recompute=selective",), "parallel.recompute / plan.recompute selective: the mixture-of-exp"),
        (
            (),
            ("parallel.ep=3",),
            "no feasible plan for qwen2-57b-a14b on 4×8 910b devices of 64 GB: closest pinned ep 3 does not divide the"
            " 64 experts",
        ),
        (
            ("--model", "qwen2-57b-a14b", "--layers", "14"),
            (),
            "--layers: qwen2-57b-a14b is a mixture of experts, which shape flags cannot change here",
        ),
    ],
)
def test_what_the_moe_plan_cannot_size_is_refused_in_one_line(tmp_path, argv, sets, needle):
    """Recompute selective (sized none or full only), an ep that divides neither the experts nor dp (once: 'none
    tried'), shape flags (once: a dense model of the MoE's shape, planned without a word)."""
    with pytest.raises(StageError) as err:
        plan_of(tmp_path, "qwen2-57b-a14b-910b", *argv, sets=sets)
    assert str(err.value).startswith(needle) and "\n" not in str(err.value), str(err.value)
    if "--layers" in argv:
        assert "--set model.n_layers" in str(err.value)


@pytest.mark.parametrize(
    "argv, key",
    [
        (("--model", "llama3-8b"), "model.n_layers=14"),
        (("--hf-config", "HF"), "model.n_layers=14"),
        (("--params", "7e9"), "model.preset=llama3-8b"),
        (("--model", "llama3-8b"), "model.hf_path=/nowhere"),
    ],
)
def test_a_model_key_under_a_what_if_model_is_refused_in_one_line(tmp_path, argv, key):
    """--set model.n_layers=14 (or model.preset, model.hf_path) with --model/--hf-config/--params once planned the
    what-if model whole, the value dropped."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_0_5B))
    argv = tuple(str(tmp_path) if a == "HF" else a for a in argv)
    with pytest.raises(StageError) as err:
        plan_of(tmp_path / "run", "demo-cpu", *argv, sets=[key])
    name = key.partition("=")[0]
    assert str(err.value).startswith(f"{name}: set for the config's model, which {argv[0]} replaces"), str(err.value)
    assert "\n" not in str(err.value)


def test_the_plan_sizes_the_run_directorys_shard_seq_len(cfg, tmp_path):
    """Train takes data.seq_len from the shard set (tasks.runner.shard_set): the plan in that run directory sizes
    the same length, not the config's; an explicit other length fails here as it would in train."""
    cfg.tracking.enabled = False
    assert cfg.data.seq_len == 128
    (tmp_path / "shard.json").write_text(json.dumps({"stage": "shard", "status": "ok", "seq_len": 64}))
    result = run_stage("plan", cfg, tmp_path, args=plan_args())
    assert read_json(result["plan_json"])["seq_len"] == 64
    # the config's other length is said, not replaced in silence
    assert "seq 64 is this run directory's shard set's, not the config's data.seq_len 128" in result["summary"]
    assert "--seq-len 128" in result["summary"] and "\n" not in result["summary"]
    with pytest.raises(StageError) as err:
        plan_of(tmp_path, "demo-cpu", sets=["data.seq_len=128"])
    assert str(err.value).startswith("data.seq_len: 128 differs from the shard set's 64")
    assert "\n" not in str(err.value)


def test_plan_flags_are_bounded_like_the_config_fields(capsys):
    """--global-batch 1e30 once reached the search (a whole number > 0): argparse refuses it now, exit 2."""
    with pytest.raises(SystemExit) as exit_:
        plan_args("--global-batch", "1e30")
    assert exit_.value.code == 2 and "--global-batch: 1e30 must be at most 16777216" in capsys.readouterr().err


def test_a_shape_override_over_a_checkpoint_is_refused_in_every_stage(tmp_path):
    """model.n_layers=14 over a checkpoint's config.json: train refused it, but the plan sized a 14-layer model of
    weights that have 24 (and fewer layers would have loaded, the rest dropped). tasks.model.resolve refuses it for
    every stage; model.rope_theta / max_seq_len over it stay honoured with a warning (tests/test_hf_io.py)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(QWEN2_0_5B))
    sets = [f"model.hf_path={tmp_path / 'ckpt'}", "model.n_layers=14"]
    with pytest.raises(ConfigError, match=r"model.n_layers: 14 differs from 24 in model.hf_path's config.json"):
        plan_of(tmp_path / "run", "demo-cpu", sets=sets)


def test_expert_parallelism_on_a_dense_model_is_refused_by_the_plan(tmp_path):
    """--set parallel.ep=2 on a dense model planned ok and was refused only by train, a stage later."""
    with pytest.raises(StageError, match=r"^parallel.ep: 2 needs a mixture-of-experts model"):
        plan_of(tmp_path / "run", "demo-cpu", sets=["parallel.ep=2", "parallel.dp=2"])
    what_if = plan_of(tmp_path / "what-if", "demo-cpu", "--model", "debug", sets=["parallel.ep=2"])  # not the config's
    assert what_if["status"] == "ok"


@pytest.mark.parametrize(
    "argv", [("--seq-len", "32768", "--nodes", "2"), ("--model", "llama3-8b", "--seq-len", "16384")]
)
def test_a_seq_len_over_the_models_context_is_planned_with_trainings_refusal_said(tmp_path, argv):
    """The plan sizes any length (memory and step time do not read the RoPE table), but training refuses one over
    model.max_seq_len (tasks/model/resolve.py): the plan warns, naming the setting, instead of an unqualified ok."""
    result = plan_of(tmp_path, "llama3-8b-h100", *argv)
    seq = argv[argv.index("--seq-len") + 1]
    assert result["status"] == "warn", result["summary"]
    assert f"training would refuse this length: data.seq_len: {seq} exceeds model max_seq_len 8192" in result["summary"]
    assert f"model.max_seq_len >= {seq}" in result["summary"] and "\n" not in result["summary"]
    assert plan_of(tmp_path, "llama3-8b-h100", "--nodes", "2")["status"] == "ok"  # within the context: no word


def test_a_llama_3_1_config_is_planned_with_trainings_rope_refusal_said(tmp_path):
    """Llama-3.1/3.2/3.3's config.json scales RoPE (rope_type llama3), which training refuses; memory and step time
    do not depend on it, so the what-if plan reads the shape and warns with training's own refusal."""
    transformers = pytest.importorskip("transformers")
    from tasks.shape import TransformerConfig

    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32)
    scaled = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    transformers.LlamaConfig(
        **shape,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={**scaled, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path / "llama-3.2-1b")
    with pytest.raises(StageError) as refusal:  # training's refusal, as model.hf_path
        TransformerConfig.from_hf_config(tmp_path / "llama-3.2-1b")
    argv = ("--hf-config", str(tmp_path / "llama-3.2-1b"), "--cluster", "h100-80g", "--nodes", "1")
    result = plan_of(tmp_path / "run", "demo-cpu", *argv, "--seq-len", "4096", "--global-batch", "64")
    assert result["status"] == "warn", result["summary"]
    assert f"training would refuse it as model.hf_path: {refusal.value}" in result["summary"]
    assert "rope_type 'llama3'" in result["summary"] and "\n" not in result["summary"]
    assert result["best"]["total_bytes"] > 0


def test_more_ranks_a_node_than_the_cluster_has_devices_is_refused_in_one_line(tmp_path):
    """hardware.nproc_per_node 16 on 910b (8 NPUs a node) was planned as one node of 16 devices without a word."""
    with pytest.raises(StageError) as err:
        plan_of(tmp_path, "qwen2-7b-910b", sets=["hardware.nproc_per_node=16"])
    assert str(err.value).startswith("hardware.nproc_per_node: 16 exceeds the 8 devices a 910b node has")
    assert "\n" not in str(err.value)
    assert plan_of(tmp_path, "llama3-70b-910c")["status"] in ("ok", "warn")  # 910c: 16 a node


def test_a_vocabulary_over_the_checkpoints_embedding_names_where_it_comes_from(tmp_path):
    """Without a shard set the size is data.vocab_size (the BPE the shard stage would train): the line said "the
    shard set's tokenizer has 151646 tokens" of a set that does not exist."""
    transformers = pytest.importorskip("transformers")
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    transformers.LlamaConfig(**shape, num_key_value_heads=2, vocab_size=128256).save_pretrained(tmp_path / "llama")
    sets = [f"model.hf_path={tmp_path / 'llama'}"]
    with pytest.raises(ConfigError) as err:
        plan_of(tmp_path / "new", "qwen2-7b-910b", sets=sets)
    assert str(err.value).startswith(
        "model.hf_path: data.vocab_size (the BPE tokenizer the shard stage would train; no shard set here) has "
        "151646 tokens but the checkpoint's embedding only 128256"
    ), str(err.value)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "shard.json").write_text(json.dumps({"status": "ok", "seq_len": 4096, "vocab_size": 151646}))
    with pytest.raises(ConfigError) as err:
        plan_of(tmp_path / "run", "qwen2-7b-910b", sets=sets)
    assert str(err.value).startswith("model.hf_path: the shard set's tokenizer has 151646 tokens but"), str(err.value)
