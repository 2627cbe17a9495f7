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


def test_drop_and_champion_rules():
    assert registry.check_threshold(2) == 2.0
    assert registry.drop_pct(10.0, 10.15) == pytest.approx(1.5)
    assert registry.drop_pct(10.0, 9.9) == pytest.approx(-1.0)
    assert registry.champion_decision(9.0, "d1", None).promote
    assert registry.champion_decision(9.0, "d1", {"version": "1", "ppl": 9.5, "digest": "d1"}).promote
    tie = registry.champion_decision(9.5, "d1", {"version": "1", "ppl": 9.5, "digest": "d1"})
    assert not tie.promote and tie.comparable and "does not beat champion v1" in tie.reason
    other = registry.champion_decision(1.0, "d2", {"version": "1", "ppl": 9.5, "digest": "d1"})
    assert not other.promote and not other.comparable and "not comparable" in other.reason


def _register(uri, name, ppl, digest):
    tags = {registry.PPL_TAG: ppl, registry.DIGEST_TAG: digest, "airflow.run_id": "manual__1", "train.run_id": "t1"}
    return registry.register(uri, name, torch.nn.Linear(4, 2), tags, [f"torch=={torch.__version__.split('+')[0]}"])


def _gate(uri, name, version, ppl, digest):
    """What evaluate does after a passed gate: candidate always, champion by the rule."""
    registry.set_alias(uri, name, registry.CANDIDATE, version)
    decision = registry.champion_decision(ppl, digest, registry.current_champion(uri, name))
    if decision.promote:
        registry.set_alias(uri, name, registry.CHAMPION, version)
    return decision


def test_candidate_and_champion_aliases_read_back(mlflow_uri):
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("registry-tests")
    name = "quant-registry-test"
    client = MlflowClient(mlflow_uri)
    with mlflow.start_run():
        assert registry.current_champion(mlflow_uri, name) is None  # no model yet
        v1 = _register(mlflow_uri, name, 10.0, "d1")
        assert _gate(mlflow_uri, name, v1, 10.0, "d1").promote  # first version: champion
        assert client.get_model_version_by_alias(name, "candidate").version == int(v1)
        assert client.get_model_version_by_alias(name, "champion").version == int(v1)
        v2 = _register(mlflow_uri, name, 10.5, "d1")  # worse: candidate only
        assert not _gate(mlflow_uri, name, v2, 10.5, "d1").promote
        assert client.get_model_version_by_alias(name, "candidate").version == int(v2)
        assert client.get_model_version_by_alias(name, "champion").version == int(v1)
        v3 = _register(mlflow_uri, name, 9.0, "d1")  # better on the same data: champion
        assert _gate(mlflow_uri, name, v3, 9.0, "d1").promote
        assert client.get_model_version_by_alias(name, "champion").version == int(v3)
        v4 = _register(mlflow_uri, name, 5.0, "d2")  # other data: not comparable, kept back
        assert not _gate(mlflow_uri, name, v4, 5.0, "d2").comparable
        assert registry.aliases(mlflow_uri, name) == {"candidate": v4, "champion": v3}
        mv = client.get_model_version(name, v3)
        assert mv.tags["airflow.run_id"] == "manual__1" and mv.tags[registry.DIGEST_TAG] == "d1"
        assert registry.find_version(mlflow_uri, name, registry.PPL_TAG, "9.0").version == int(v3)
        assert mv.source.startswith("models:/")  # registered from the LoggedModel
