"""The evaluation gate and the MLflow Model Registry: candidate on passing the accuracy gate, champion when it also
beats the current champion on the same validation data. Aliases, never stages (deprecated in MLflow 3).

Champion rule: perplexities are compared only when both were measured on the same shard set (same manifest
digest): other validation tokens, maybe another tokenizer, make perplexities incomparable, so a candidate from new
data is not promoted automatically — the result says so and how to promote by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.errors import ConfigError, StageError

CANDIDATE, CHAMPION = "candidate", "champion"
PPL_TAG, DIGEST_TAG = "eval.int8_ppl", "data.manifest_digest"


def check_threshold(max_drop_pct) -> float:
    if (
        isinstance(max_drop_pct, bool)
        or not isinstance(max_drop_pct, (int, float))
        or not math.isfinite(max_drop_pct)
        or not 0 <= max_drop_pct <= 100
    ):
        raise ConfigError(f"evaluate.max_drop_pct: {max_drop_pct!r} must be a number in [0, 100] (percent)")
    return float(max_drop_pct)


def drop_pct(fp_ppl: float, int8_ppl: float) -> float:
    """Relative perplexity increase of the INT8 model, in percent (negative: INT8 scored better)."""
    return (int8_ppl - fp_ppl) / fp_ppl * 100.0


@dataclass(frozen=True)
class Promotion:
    promote: bool
    reason: str
    comparable: bool = True  # False: the champion was measured on other data, a human has to decide


def champion_decision(candidate_ppl: float, candidate_digest: str, champion: dict | None) -> Promotion:
    """`champion` is {"version", "ppl", "digest"} of the current champion, or None."""
    if champion is None:
        return Promotion(True, "no champion yet")
    v = champion["version"]
    if champion.get("digest") != candidate_digest or champion.get("ppl") is None:
        return Promotion(
            False,
            f"champion v{v} was evaluated on data {champion.get('digest') or '?'}, this model on "
            f"{candidate_digest}: perplexities are not comparable; promote by hand after review",
            comparable=False,
        )
    if candidate_ppl < champion["ppl"]:
        return Promotion(True, f"beats champion v{v} ({candidate_ppl:.4f} < {champion['ppl']:.4f})")
    return Promotion(False, f"does not beat champion v{v} ({candidate_ppl:.4f} >= {champion['ppl']:.4f})")


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def current_champion(uri: str, name: str) -> dict | None:
    from mlflow.exceptions import MlflowException

    try:
        mv = _client(uri).get_model_version_by_alias(name, CHAMPION)
    except MlflowException:  # no such model, or no champion alias yet
        return None
    ppl = mv.tags.get(PPL_TAG)
    return {"version": str(mv.version), "ppl": float(ppl) if ppl else None, "digest": mv.tags.get(DIGEST_TAG)}


def find_version(uri: str, name: str, tag: str, value: str):
    """An existing version carrying tag=value (a rerun of the same evaluation reuses it: idempotent)."""
    from mlflow.exceptions import MlflowException

    try:
        found = _client(uri).search_model_versions(f"name = '{name}' and tags.`{tag}` = '{value}'")
    except MlflowException:
        return None
    return max(found, key=lambda mv: int(mv.version)) if found else None


def register(uri: str, name: str, model, tags: dict, pip_requirements: list[str]) -> str:
    """Log the model as a LoggedModel in the active run and register it; returns the new version."""
    import mlflow
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    if mlflow.active_run() is None:
        raise StageError("model registry: no active MLflow run (tracking disabled?)")
    # pickle: the registered model is our module itself (any batch and sequence length, torchao weights inside);
    # pt2 would freeze the example's shapes into a GraphModule. The signature is declared, not inferred from an
    # input example: inference runs the model and cannot represent BF16 logits in numpy.
    signature = ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.int64), (-1, -1), "tokens")]))
    info = mlflow.pytorch.log_model(
        model, name="int8_model", serialization_format="pickle", signature=signature, pip_requirements=pip_requirements
    )
    mv = mlflow.register_model(info.model_uri, name, tags={k: str(v) for k, v in tags.items()})
    return str(mv.version)


def set_alias(uri: str, name: str, alias: str, version: str) -> None:
    _client(uri).set_registered_model_alias(name, alias, version)


def promote(uri: str, name: str, version: str, by: str = "", reason: str = "") -> None:
    """Make `version` of registered model `name` the champion (the alias, moved from whichever version held it);
    the version records who promoted it and why (tags `champion.approved_by`, `champion.reason`)."""
    client = _client(uri)
    client.set_registered_model_alias(name, CHAMPION, str(version))
    for key, value in (("champion.approved_by", by), ("champion.reason", reason)):
        if value:
            client.set_model_version_tag(name, str(version), key, str(value)[:5000])


def aliases(uri: str, name: str) -> dict[str, str]:
    return {alias: str(v) for alias, v in _client(uri).get_registered_model(name).aliases.items()}
