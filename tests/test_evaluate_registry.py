"""The gate's rules and the MLflow Model Registry aliases, against a real SQLite-backed MLflow."""

from __future__ import annotations

import shutil

import pytest
import torch

from tasks.errors import ConfigError, StageError
from tasks.quant import registry


@pytest.mark.parametrize("bad", [-1, 100.5, float("nan"), float("inf"), "2%", True, None])
def test_invalid_threshold_is_one_line_config_error(bad):
    with pytest.raises(ConfigError, match=r"evaluate.max_drop_pct: .* must be a number in \[0, 100\]") as e:
        registry.check_threshold(bad)
    assert "\n" not in str(e.value)


def test_gate_drop_and_champion_rules():
    from tasks.quant.gate import relative_drop

    assert registry.check_threshold(2) == 2.0
    assert relative_drop(0.50, 0.49) == pytest.approx(2.0) and relative_drop(0.50, 0.51) == pytest.approx(-2.0)
    assert relative_drop(0.0, 0.3) == 0.0
    assert registry.champion_decision(0.5, None, 0.0).promote
    better = registry.champion_decision(0.61, {"version": "1", "macro": 0.60}, 0.0)
    assert better.promote and "+1.67%" in better.reason
    tie = registry.champion_decision(0.60, {"version": "1", "macro": 0.60}, 0.0)
    assert tie.promote and tie.comparable  # "not lower": a retrain as good as the champion takes over
    worse = registry.champion_decision(0.59, {"version": "1", "macro": 0.60}, 0.0)
    assert not worse.promote and worse.comparable and "below champion v1 by more than the margin" in worse.reason
    assert registry.champion_decision(0.59, {"version": "1", "macro": 0.60}, 2.0).promote  # 1.67 % ≤ 2 %
    assert not registry.champion_decision(0.58, {"version": "1", "macro": 0.60}, 2.0).promote  # 3.3 % > 2 %
    lost = registry.champion_decision(0.9, {"version": "1", "problem": "registered without its tokenizer"}, 0.0)
    assert not lost.promote and not lost.comparable and "promote by hand" in lost.reason


def _register(uri, name, macro, digest):
    import numpy as np

    tags = {registry.TASKS_TAG: macro, registry.DIGEST_TAG: digest, "airflow.run_id": "manual__1", "train.run_id": "t1"}
    example = np.arange(8, dtype=np.int64).reshape(1, 8)
    return registry.register(
        uri,
        name,
        torch.nn.Linear(4, 2),
        tags,
        [f"torch=={torch.__version__.split('+')[0]}"],
        description="d",
        input_example=example,
    )


def _gate(uri, name, version, macro, champion_macro):
    """What evaluate does after a passed gate: candidate always, champion by the rule (champion measured again)."""
    registry.set_alias(uri, name, registry.CANDIDATE, version)
    champ = registry.current_champion(uri, name)
    decision = registry.champion_decision(macro, champ and dict(champ, macro=champion_macro), 0.0)
    if decision.promote:
        registry.set_alias(uri, name, registry.CHAMPION, version)
    return decision


def test_candidate_and_champion_aliases_read_back(mlflow_uri, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("registry-tests")
    name = "quant-registry-test"
    client = MlflowClient(mlflow_uri)
    with mlflow.start_run():
        assert registry.current_champion(mlflow_uri, name) is None  # no model yet
        v1 = _register(mlflow_uri, name, 0.60, "d1")
        assert _gate(mlflow_uri, name, v1, 0.60, None).promote  # first version: champion
        assert client.get_model_version_by_alias(name, "candidate").version == int(v1)
        assert client.get_model_version_by_alias(name, "champion").version == int(v1)
        v2 = _register(mlflow_uri, name, 0.55, "d1")  # worse on the tasks: candidate only
        assert not _gate(mlflow_uri, name, v2, 0.55, 0.60).promote
        assert client.get_model_version_by_alias(name, "candidate").version == int(v2)
        assert client.get_model_version_by_alias(name, "champion").version == int(v1)
        v3 = _register(mlflow_uri, name, 0.62, "d2")  # other data, better on the same tasks: champion, no hand step
        assert _gate(mlflow_uri, name, v3, 0.62, 0.60).promote
        assert registry.aliases(mlflow_uri, name) == {"candidate": v3, "champion": v3}
        mv = client.get_model_version(name, v3)
        assert mv.tags["airflow.run_id"] == "manual__1" and mv.tags[registry.DIGEST_TAG] == "d2"
        assert mv.description == "d"
        assert registry.find_version(mlflow_uri, name, registry.TASKS_TAG, "0.62").version == int(v3)
        assert mv.source.startswith("models:/")  # registered from the LoggedModel
        champ = registry.current_champion(mlflow_uri, name)
        local = registry.download(champ["uri"], tmp_path / "champion")  # what evaluate runs again
        with pytest.raises(StageError, match=r"only as a pickled module, which is not loaded: unpickling runs code"):
            registry.load_registered(local, "cpu")  # no safetensors extra files: the pickle is never opened
        from mlflow.models import Model

        mlmodel = Model.load(str(local))
        example = mlmodel.load_input_example(str(local))
        assert mlmodel.saved_input_example_info and list(example.values())[0].tolist() == [list(range(8))], {
            k: type(v) for k, v in example.items()
        }
        assert mlmodel.signature.inputs.to_dict()[0]["tensor-spec"]["dtype"] == "int64"


def test_aliases_move_only_in_runs_of_the_models_own_dag(mlflow_uri):
    """The first DAG run that moves an alias makes that DAG the model's owner; a CLI/test run or another DAG's run
    registers but moves nothing."""
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("registry-tests")
    name = "quant-owner-test"
    with mlflow.start_run():
        _register(mlflow_uri, name, 0.5, "d1")
    cli = registry.may_move_aliases(mlflow_uri, name, None)
    assert cli == (False, f"a run outside Airflow (CLI or test) registers {name} but moves no alias")
    assert registry.may_move_aliases(mlflow_uri, name, "llm_pipeline") == (True, "")  # first DAG run: owner
    assert registry.may_move_aliases(mlflow_uri, name, "llm_pipeline") == (True, "")
    other, why = registry.may_move_aliases(mlflow_uri, name, "someone_elses_dag")
    assert not other and "belongs to DAG llm_pipeline" in why


def test_int8_safetensors_round_trip_and_corruption(tmp_path):
    """The torchao INT8 state dict as safetensors + quantization_config.json loads back into the same model
    (weight-only, W8A8, SmoothQuant; tied embeddings); a flipped byte is refused with one line; the torch.save path
    still loads."""
    import json

    from tasks.errors import StageError
    from tasks.fsutil import sha256_file
    from tasks.model.config import get_preset
    from tasks.model.hf_io import save_hf
    from tasks.model.transformer import build_model, materialize
    from tasks.quant import artifact, torchao_backend
    from tasks.quant.artifact import describe_layers

    tcfg = get_preset("debug")
    tcfg.tie_embeddings = True
    save_hf(materialize(build_model(tcfg, "cpu"), "cpu", seed=0), tmp_path / "hf")
    tokens = torch.randint(0, tcfg.vocab_size, (2, 12))
    for method in ("int8_weight_only", "int8_dynamic", "smoothquant"):
        from tasks.model.hf_io import load_hf

        model = load_hf(tmp_path / "hf").to(torch.bfloat16).eval()
        model.init_rope()
        names = [layer.name for layer in describe_layers(model) if layer.type == "Linear" and layer.name != "output"]
        torchao_backend.quantize(model, method, names, [(tokens, None)], "cpu")  # calibration: SmoothQuant
        out = tmp_path / method
        out.mkdir()
        artifact.save_model(model, out / artifact.WEIGHTS, "torch_state_dict")
        meta = {
            "format": "torch_state_dict",
            "model_dir": str(tmp_path / "hf"),
            "method": method,
            "quantized_layers": names,
            "skipped_layers": ["output"],
            "dtype": "bf16",
            "int8_bytes": (out / artifact.WEIGHTS).stat().st_size,
            "weights_sha256": sha256_file(out / artifact.WEIGHTS),
        }
        meta.update(artifact.save_safetensors(model, out, meta))
        (out / artifact.META).write_text(json.dumps(meta))
        qc = json.loads((out / artifact.QUANT_CONFIG).read_text())
        assert qc["quant_method"] == "torchao" and qc["method"] == method and qc["sha256"] == meta["safetensors_sha256"]
        assert qc["tied_layers_stored_once"] == ["output.weight"]
        # what a registered version carries as extra files: config.json + the safetensors + its config, no pickle
        reg = tmp_path / f"registered-{method}"
        reg.mkdir()
        for f in (tmp_path / "hf" / "config.json", out / artifact.SAFETENSORS, out / artifact.QUANT_CONFIG):
            shutil.copy(f, reg)
        with torch.no_grad():
            want = artifact.load_quantized(out, pack=False)(tokens)
            got = artifact.load_quantized(out, pack=False, source="safetensors")(tokens)
            registered = artifact.load_registered_files(reg, pack=False)(tokens)
        assert torch.equal(want, got) and torch.equal(model(tokens), got) and torch.equal(registered, got)
    data = bytearray((out / artifact.SAFETENSORS).read_bytes())
    data[-1] ^= 0xFF
    (out / artifact.SAFETENSORS).write_bytes(bytes(data))
    assert "model_int8.safetensors is missing or corrupt" in artifact.verify_output(out)
    with pytest.raises(StageError, match=r"model_int8.safetensors is missing or corrupt .*; rerun the quantize stage"):
        artifact.load_quantized(out, source="safetensors")
