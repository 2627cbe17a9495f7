"""The gate's rules and the MLflow Model Registry aliases, against a real SQLite-backed MLflow."""

from __future__ import annotations

import pytest
import torch

from tasks.errors import ConfigError
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
    tags = {registry.TASKS_TAG: macro, registry.DIGEST_TAG: digest, "airflow.run_id": "manual__1", "train.run_id": "t1"}
    return registry.register(
        uri, name, torch.nn.Linear(4, 2), tags, [f"torch=={torch.__version__.split('+')[0]}"], description="d"
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
        model = registry.load_registered(local, "cpu")
        assert isinstance(model, torch.nn.Linear) and model.weight.shape == (2, 4)
