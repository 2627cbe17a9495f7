"""The evaluation gate's threshold and the MLflow Model Registry: candidate on passing the gate, champion when its task
accuracy is not lower than the current champion's, both evaluated on the same tasks in the same run. Aliases, never
stages (deprecated in MLflow 3).

Champion rule: the tasks are text, so models with different tokenizers or trained on other data are comparable;
each version is registered with its tokenizer and config.json (extra files), which is how evaluate runs the champion
again. A champion registered before that, without a tokenizer, is comparable only when it was measured on the same
shard set (whose tokenizer is then its own); otherwise the result says so and how to promote by hand.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import ConfigError, StageError

CANDIDATE, CHAMPION = "candidate", "champion"
PPL_TAG, DIGEST_TAG, TASKS_TAG = "eval.int8_ppl", "data.manifest_digest", "eval.task_macro"
OWNER_TAG = "airflow.dag_id"  # on the registered model: the DAG whose runs move its aliases
EXTRA = "extra_files"  # where mlflow.pytorch.log_model puts `extra_files` inside the model's artifacts


def check_threshold(max_drop_pct) -> float:
    if (
        isinstance(max_drop_pct, bool)
        or not isinstance(max_drop_pct, (int, float))
        or not math.isfinite(max_drop_pct)
        or not 0 <= max_drop_pct <= 100
    ):
        raise ConfigError(f"evaluate.max_drop_pct: {max_drop_pct!r} must be a number in [0, 100] (percent)")
    return float(max_drop_pct)


@dataclass(frozen=True)
class Promotion:
    promote: bool
    reason: str
    comparable: bool = True  # False: the champion could not be measured on the tasks, a human has to decide


def champion_decision(candidate: float, champion: dict | None, margin_pct: float) -> Promotion:
    """`candidate`: the candidate's macro task accuracy; `champion`: {"version", "macro"} measured in the same run on
    the same tasks (or {"version", "problem"} when it could not be), or None. Promote unless the candidate is lower
    by more than `margin_pct` percent of the champion's."""
    if champion is None:
        return Promotion(True, "no earlier champion to compare with")
    v = champion["version"]
    if champion.get("macro") is None:
        return Promotion(False, f"champion v{v}: {champion['problem']}; promote by hand after review", False)
    c = champion["macro"]
    change = (candidate - c) / c * 100.0 if c else 0.0
    figures = f"macro task accuracy {candidate:.4f} vs champion v{v} {c:.4f} ({change:+.2f}%, margin {margin_pct:g}%)"
    if -change <= margin_pct:
        return Promotion(True, f"not below champion v{v} by more than the margin: {figures}")
    return Promotion(False, f"below champion v{v} by more than the margin: {figures}")


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def current_champion(uri: str, name: str) -> dict | None:
    """{"version", "digest", "uri"} of the version with the champion alias, or None."""
    from mlflow.exceptions import MlflowException

    try:
        mv = _client(uri).get_model_version_by_alias(name, CHAMPION)
    except MlflowException:  # no such model, or no champion alias yet
        return None
    return {"version": str(mv.version), "digest": mv.tags.get(DIGEST_TAG), "uri": f"models:/{name}/{mv.version}"}


def download(model_uri: str, dst: Path) -> Path:
    """The registered model's files (MLmodel, weights, extra files) into `dst`; → the local model folder."""
    import mlflow

    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))


def load_registered(local: Path, device):
    """The registered INT8 model from a downloaded model folder, on `device`, from its safetensors extra files
    (artifact.load_registered_files): the pickled module MLflow's pytorch flavour also stores is never unpickled
    (that would run code from whoever can write to the registry). A version registered before the safetensors form
    cannot be loaded here: one line saying so."""
    from tasks.quant.artifact import QUANT_CONFIG, SAFETENSORS, load_registered_files

    extra = Path(local) / EXTRA
    if not all((extra / f).is_file() for f in (SAFETENSORS, QUANT_CONFIG, "config.json")):
        raise StageError(
            f"registered without {SAFETENSORS} + {QUANT_CONFIG} (only as a pickled module, which is not loaded: "
            "unpickling runs code); evaluate a newer version or register it again"
        )
    return load_registered_files(extra, device)


def find_version(uri: str, name: str, tag: str, value: str):
    """An existing version carrying tag=value (a rerun of the same evaluation reuses it: idempotent)."""
    from mlflow.exceptions import MlflowException

    try:
        found = _client(uri).search_model_versions(f"name = '{name}' and tags.`{tag}` = '{value}'")
    except MlflowException:
        return None
    return max(found, key=lambda mv: int(mv.version)) if found else None


def register(
    uri: str,
    name: str,
    model,
    tags: dict,
    pip_requirements: list[str],
    extra_files: list[str] | None = None,
    description: str | None = None,
    artifact: str = "int8_model",
    input_example=None,
) -> str:
    """Log the model as a LoggedModel `artifact` in the active run (with `extra_files`: its tokenizer and config.json,
    the safetensors forms) and an `input_example` (token ids) and register it, with `description`; → the new
    version."""
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
    # The example is stored with the model (MLmodel's saved_input_example_info). Model.log then tries to serve it
    # (mlflow/models/model.py, _validate_serving_input) and can only warn: pyfunc's predict turns the output into
    # numpy (mlflow/pytorch/__init__.py, _PyTorchWrapper.predict), which has no BF16 — that one warning is dropped.
    with _quiet_serving_check():
        info = mlflow.pytorch.log_model(
            model,
            name=artifact,
            serialization_format="pickle",
            signature=signature,
            input_example=input_example,
            pip_requirements=pip_requirements,
            extra_files=extra_files or None,
        )
    mv = mlflow.register_model(info.model_uri, name, tags={k: str(v) for k, v in tags.items()})
    if description:
        _client(uri).update_model_version(name, mv.version, description=description)
    return str(mv.version)


@contextlib.contextmanager
def _quiet_serving_check():
    class Drop(logging.Filter):
        def filter(self, record):
            return not record.getMessage().startswith("Failed to validate serving input example")

    log, drop = logging.getLogger("mlflow.models.model"), Drop()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def link(uri: str, name: str, version: str, tags: dict, drop: tuple[str, ...] = ()) -> None:
    """Tags on an existing version (the INT8 and BF16 versions name each other; a rerun's evaluation), and the tags
    in `drop` removed where the version has them."""
    client = _client(uri)
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, str(v))
    have = client.get_model_version(name, str(version)).tags if drop else {}
    for k in drop:
        if k in have:
            client.delete_model_version_tag(name, str(version), k)


def may_move_aliases(uri: str, name: str, dag_id: str | None) -> tuple[bool, str]:
    """Aliases move only in runs of the registered model's own DAG: the DAG whose run first moved them (the model's
    OWNER_TAG, set then). A CLI or test run (no DAG) or another DAG's run registers versions but moves nothing.
    → (allowed, why not)."""
    if not dag_id:
        return False, f"a run outside Airflow (CLI or test) registers {name} but moves no alias"
    client = _client(uri)
    owner = client.get_registered_model(name).tags.get(OWNER_TAG)
    if owner is None:
        client.set_registered_model_tag(name, OWNER_TAG, dag_id)
    elif owner != dag_id:
        return False, f"a run of DAG {dag_id} registers {name} but moves no alias ({name} belongs to DAG {owner})"
    return True, ""


def describe(uri: str, name: str, version: str, description: str) -> None:
    _client(uri).update_model_version(name, version, description=description)


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
