"""MLflow tracking: one parent run per DAG run, one child run per stage, rank-0-only logging.

mlflow is imported inside functions: DAG files import tasks lazily, and the parser must stay fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from tasks.config import REPO_ROOT, PipelineConfig, repo_path, var_dir
from tasks.errors import StageError
from tasks.fsutil import read_jsonl

_KEY_BAD = re.compile(r"[^/\w.\- ]")  # MLflow accepts ^[/\w.\- ]*$
log = logging.getLogger("tasks.tracking")

# The MLflow UI's view of an experiment. MLflow 3.17 reads the experiment tag `mlflow.experimentKind`
# (values in mlflow/server/js: genai_development, custom_model_development, finetuning, …) and its GenAI / Model
# training switch, which it takes from the URL's `workflowType` (genai | machine_learning) before the browser's
# remembered choice (React context keyed "mlflow.workflowType"): the experiment carries the tag and every link
# printed here carries the parameter, so a first visit opens the run list, not the GenAI overview.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
UI_VIEW = "workflowType=machine_learning"
# MLflow's limits (mlflow/utils/validation.py): a param value holds 6000 characters, a key 250.
MAX_PARAM_VALUE, TRUNCATED = 6000, "…[truncated]"
# The figures a person looks at first. The UI groups a run's charts by the key's part before "/", sections in
# alphabetical order and before the ungrouped "Model metrics": these go in the "train" section, the rest of the
# trainer's figures stay ungrouped (`train.lr`, `train.grad_norm`, …) below them.
HEADLINE = ("loss", "val.loss", "tokens_per_s")


def sanitize_key(key: str) -> str:
    """Make any string a legal MLflow metric/param key ("loss(fp32)@step" → "loss_fp32__step")."""
    return _KEY_BAD.sub("_", str(key))[:250] or "_"


def model_name_problem(name: str) -> str | None:
    """One line when MLflow's Model Registry would refuse `name` (checked at trigger time, not at evaluate after the
    whole run): MLflow 3.17's own rules, mlflow.utils.validation._validate_model_name (not empty, no '/' or ':', not
    changed by path normalisation) and the file store's (mlflow/store/model_registry/file_store.py: no path separator,
    no '%').

    A plain name (letters, digits, '_', '-', dot-separated words) passes all of them, and is accepted without
    importing MLflow (seconds of CPU, in every task that loads the config); any other goes to MLflow's rules."""
    if re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", name or ""):
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.store.model_registry.file_store import _validate_model_name

    try:
        _validate_model_name(name)
    except MlflowException as e:
        return (
            f"evaluate.registered_model: {name!r} is refused by MLflow's Model Registry ({e.message}); choose another"
        )
    return None


def default_uri() -> str:
    return f"sqlite:///{var_dir() / 'mlflow.db'}"


def tracking_uri(cfg: PipelineConfig | None = None) -> str:
    if cfg is not None and cfg.tracking.uri:
        return cfg.tracking.uri
    return os.environ.get("MLFLOW_TRACKING_URI") or default_uri()


DEFAULT_UI_URL = "http://127.0.0.1:5000"


def ui_url(cfg: PipelineConfig | None = None) -> str:
    """The MLflow UI's base URL, one setting read by everything that prints or serves a run link (the end-of-run
    summary, the pipeline's closing hint, plugins/mlflow_link.py): tracking.ui_url when set, else $MLFLOW_UI_URL
    (`make ui` and docker-compose export it), else the tracking server itself when the store is one (an http(s)
    tracking URI: `mlflow server` serves its UI there; the URI's user and password left out), else
    http://127.0.0.1:5000 on port $MLFLOW_PORT when set (the port `make ui` serves on)."""
    from urllib.parse import urlsplit, urlunsplit

    if cfg is not None and cfg.tracking.ui_url:
        return cfg.tracking.ui_url.rstrip("/")
    default = DEFAULT_UI_URL
    store = tracking_uri(cfg)
    if store.startswith(("http://", "https://")):
        u = urlsplit(store)
        host = u.netloc.rsplit("@", 1)[-1]  # without user:password@
        if host:
            default = urlunsplit((u.scheme, host, u.path, "", ""))
    elif os.environ.get("MLFLOW_PORT", "").strip().isdigit():
        default = f"{DEFAULT_UI_URL.rsplit(':', 1)[0]}:{os.environ['MLFLOW_PORT'].strip()}"
    return (os.environ.get("MLFLOW_UI_URL") or default).rstrip("/")


def run_url(run_id: str, cfg: PipelineConfig | None = None, experiment_id: str | None = None) -> str:
    """A run's page in the MLflow UI, in the model-training view. Without the experiment id MLflow's
    experiment-free route `#/runs/<id>` (it redirects to the run, dropping the view parameter)."""
    if experiment_id:
        return f"{ui_url(cfg)}/#/experiments/{experiment_id}/runs/{run_id}?{UI_VIEW}"
    return f"{ui_url(cfg)}/#/runs/{run_id}"


def experiment_url(experiment_id: str, cfg: PipelineConfig | None = None) -> str:
    return f"{ui_url(cfg)}/#/experiments/{experiment_id}?{UI_VIEW}"


def ui_hint(cfg: PipelineConfig | None = None, experiment_id: str | None = None) -> str:
    """Where to look at the runs: the configured UI, and `make ui` to start it (with a login) when nothing serves
    it — never a bare `mlflow ui`, which would serve the store to anyone who can reach the port."""
    where = experiment_url(experiment_id, cfg) if experiment_id else ui_url(cfg)
    return f"MLflow: {where}  (not running? `make ui` starts it with a login; `make stop` stops it)"


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def git_sha() -> str:
    """The commit the code is at: LLM_PIPELINE_GIT_SHA when set (the images: `--build-arg GIT_SHA=...`, their build
    context has no .git), else `git rev-parse` of the checkout, else "unknown"."""
    given = os.environ.get("LLM_PIPELINE_GIT_SHA", "").strip()
    if given and given != "unknown":
        return given
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# MLflow's HTTP client retries 7 times with exponential backoff and a 120 s timeout by default: minutes of hang per
# call while a server is down. Tracking must never hold up the pipeline, so calls fail fast and what was not sent is
# sent later (metrics from metrics.jsonl, see backfill_metrics / flush_pending).
_BOUNDED_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
PENDING = "tracking-pending.json"


# MLflow's artifact transfers draw tqdm bars on stderr (mlflow/utils/file_utils.py, ArtifactProgressBar: one
# "Downloading artifacts: 100%|…| 1/1 [00:00<00:00, 457.59it/s]" per file of a registered champion) — noise in the
# task log, read by MLflow at each transfer.
_NO_BARS = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def bound_http() -> None:
    for k, v in {**_BOUNDED_HTTP, **_NO_BARS}.items():
        os.environ.setdefault(k, v)


def _configure(cfg: PipelineConfig):
    import mlflow

    bound_http()
    uri = tracking_uri(cfg)
    source = "config" if cfg.tracking.uri else "env"
    lock = contextlib.nullcontext()
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :].split("?", 1)[0])
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from tasks.errors import os_error_cause

            raise StageError(store_problem(uri, source, os_error_cause(e))) from None
        problem = sqlite_problem(db)  # before MLflow, which retries an unopenable file for ~100 s
        if problem:
            raise StageError(store_problem(uri, source, problem))
        lock = _file_lock(db.with_name(db.name + ".init-lock"))
    check_reachable(uri, source=source)
    try:
        with lock:  # two processes opening a new SQLite store at once would both run its schema migrations
            client = mlflow.MlflowClient(uri)
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
    except Exception as e:  # a URI MLflow cannot use (a scheme typo, a missing DB driver, a file store): one line
        raise StageError(store_problem(uri, source, _store_cause(e))) from None
    if exp is not None and exp.lifecycle_stage == "deleted":  # MLflow refuses runs in it, and a new one of its name
        raise StageError(
            f"MLflow experiment {cfg.tracking.experiment!r} (id {exp.experiment_id}) at {redact(uri)} is deleted: "
            f"restore it (MLflow UI, or `mlflow experiments restore --experiment-id {exp.experiment_id}`), or use "
            "another name with --set tracking.experiment=…"
        )
    if exp is None:
        root = cfg.tracking.artifact_root or str(var_dir() / "mlartifacts")
        if "://" not in root:
            root = str(repo_path(root))
        if not cfg.tracking.artifact_root and uri.startswith(("http://", "https://")):
            root = None  # a tracking server's own default: `--serve-artifacts` stores them, whichever host logs
        try:
            exp_id = client.create_experiment(
                cfg.tracking.experiment, artifact_location=root, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
            )
        except Exception as e:  # created concurrently by another task: use theirs
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
            if exp is None:
                raise StageError(
                    f"cannot create MLflow experiment {cfg.tracking.experiment!r} at {redact(uri)} "
                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                ) from None
            exp_id = exp.experiment_id
    else:
        exp_id = exp.experiment_id
        if EXPERIMENT_KIND_TAG not in exp.tags:  # made by an older version; a kind someone chose stays
            client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    mlflow.set_tracking_uri(uri)  # process-wide only once the store is known good: a refused URI is not left behind
    mlflow.set_experiment(experiment_id=exp_id)
    return mlflow, client, exp_id


def redact(uri: str) -> str:
    """A URI as it may be shown or logged: the password of `scheme://user:password@host` replaced by `***`."""
    return re.sub(r"^([\w+.-]+://[^/@:]*):[^/]*@", r"\1:***@", str(uri))


def store_problem(uri: str, source: str, cause: str) -> str:
    """One line for a tracking URI MLflow cannot use: the URI (no password), why, and where to fix it."""
    if source == "config":
        fix = (
            "fix tracking.uri (the preset's or a --set; empty: $MLFLOW_TRACKING_URI, else the local store), "
            "or run with --no-tracking"
        )
    else:
        fix = f"fix $MLFLOW_TRACKING_URI (unset: the local store {default_uri()}), or run with --no-tracking"
    return f"MLflow tracking store {redact(uri)} is unusable ({cause}); {fix}"


def sqlite_problem(db: Path) -> str | None:
    """Why SQLite cannot hold an MLflow store at `db` (a directory, not a database, not writable), else None."""
    import sqlite3

    if db.is_dir():
        return f"{db} is a directory, not an SQLite file"
    if not os.access(db.parent, os.W_OK | os.X_OK):  # SQLite writes its journal beside the file
        return f"{db.parent} is not writable"
    if db.exists():
        if not os.access(db, os.R_OK | os.W_OK):
            return f"{db} is not readable and writable"
        try:
            conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
            try:
                conn.execute("PRAGMA schema_version")
            finally:
                conn.close()
        except sqlite3.Error as e:
            if "locked" in str(e) or "busy" in str(e):  # another task writing to it: a store in use, not a broken one
                return None
            return f"{db}: {e}"
    return None


def _store_cause(e: Exception) -> str:
    """The short reason MLflow (or its DB driver) gives for refusing a store URI."""
    text = str(getattr(e, "message", None) or e).strip()
    if isinstance(e, ModuleNotFoundError):
        return (
            f"its database driver is not installed (No module named {e.name!r}): install it, or log through an "
            "MLflow server (http://…)"
        )
    if "unsupported URI" in text:
        return "an unknown scheme; MLflow takes sqlite:///<file>, http(s)://<server>, postgresql://, mysql://, …"
    if "filesystem tracking backend" in text:
        return "a file store (a plain path or file:), which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///<path>/mlflow.db"
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:300]}"


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_reachable(uri: str, timeout: float = 5.0, source: str = "") -> None:
    """An http(s) tracking server that does not answer fails now, in one line, not after minutes of retries.
    `source`: where the URI came from ("config": tracking.uri, "env": $MLFLOW_TRACKING_URI), which decides the fix."""
    if not uri.startswith(("http://", "https://")):
        return
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout).read()
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:  # InvalidURL: a bad port
        reason = getattr(e, "reason", e)
        if source == "config":  # tracking.uri beats $MLFLOW_TRACKING_URI: the variable cannot help here
            fix = (
                "it is tracking.uri (the preset's or a --set), which beats $MLFLOW_TRACKING_URI: start it (make ui), "
                "give another with --set tracking.uri=… (empty: $MLFLOW_TRACKING_URI, else the local store), or run "
                "with --no-tracking"
            )
        elif source == "env":
            fix = (
                "it is $MLFLOW_TRACKING_URI: start it (make ui), or set MLFLOW_TRACKING_URI to a server that answers "
                "(unset: the local store)"
            )
        else:
            fix = "start it (make ui) or set MLFLOW_TRACKING_URI / tracking.uri"
        raise StageError(f"MLflow tracking server {redact(uri)} is unreachable ({reason}); {fix}") from None
    # /health is exempt from MLflow's Host-header check (mlflow/server/security.py): an API path is not, and a server
    # that does not allow the name this URI uses answers every call 403 — said now, not at the first logged value
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1", timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 403 and "Invalid Host header" in e.read().decode("utf-8", "replace"):
            host = urllib.parse.urlsplit(uri).netloc
            raise StageError(
                f"MLflow tracking server {uri} refuses the host name {host!r} (403 Invalid Host header): start it "
                f"with --allowed-hosts including {host} (or MLFLOW_SERVER_ALLOWED_HOSTS; docs/scale-out.md)"
            ) from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        pass  # it answered /health: anything else here is for the call that needs it to say


def _find_parent(client, exp_id: str, dag_id: str, run_id: str):
    found = client.search_runs(
        [exp_id],
        filter_string=f"tags.`airflow.dag_id` = '{dag_id}' and "
        f"tags.`airflow.run_id` = '{run_id}' and tags.`pipeline.kind` = 'parent'",
        max_results=1,
    )
    return found[0] if found else None


def parent_run(cfg: PipelineConfig, dag_id: str, run_id: str, try_number: int = 1) -> str:
    """Get or create the parent run of one DAG run (idempotent: a retried task finds the same parent)."""
    mlflow, client, exp_id = _configure(cfg)
    found = _find_parent(client, exp_id, dag_id, run_id)
    if found:
        return found.info.run_id
    run = client.create_run(
        exp_id,
        run_name=f"{dag_id}/{run_id}",
        tags={
            "airflow.dag_id": dag_id,
            "airflow.run_id": run_id,
            "airflow.try_number": str(try_number),
            "pipeline.kind": "parent",
            "git.sha": git_sha(),
            "config.hash": cfg.digest(),
            "config.preset": cfg.preset,
        },
    )
    from mlflow.entities import Param

    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in config_params(cfg).items()])
    client.log_text(run.info.run_id, json.dumps(shown_config(cfg), indent=2), "config.json")
    return run.info.run_id


def param_value(value) -> str:
    """A value as an MLflow param: text, cut to MLflow's 6000 characters with a visible marker."""
    text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - len(TRUNCATED)] + TRUNCATED


def config_params(cfg: PipelineConfig) -> dict[str, str]:
    """The run's whole config, flattened: `train.lr`, `model.preset`, `parallel.dp`, … (the preset as
    `config.preset`): what makes runs comparable side by side in MLflow."""
    flat = {"config.preset": cfg.preset or ""}
    flat.update({sanitize_key(k): param_value(v) for k, v in _flatten(shown_config(cfg)).items()})
    return flat


def shown_config(cfg: PipelineConfig) -> dict:
    """The config as MLflow stores it (params, the parent's config.json): a password in tracking.uri replaced."""
    d = cfg.to_dict()
    if d.get("tracking", {}).get("uri"):
        d["tracking"]["uri"] = redact(d["tracking"]["uri"])
    return d


def record_asset_event(cfg: PipelineConfig, parent_run_id: str, event: dict) -> None:
    """The asset event that triggered this DAG run, on its parent run: tags to filter by, the event as JSON."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg))
    tags = {
        "trigger.kind": "asset",
        "trigger.asset_uri": event.get("uri"),
        "trigger.asset_name": event.get("name"),
        "trigger.manifest_digest": event.get("manifest_digest"),
        "trigger.source_dag_id": event.get("source_dag_id"),
        "trigger.source_run_id": event.get("source_run_id"),
        "trigger.timestamp": event.get("timestamp"),
    }
    for key, value in tags.items():
        if value:
            client.set_tag(parent_run_id, key, str(value)[:5000])
    client.log_text(parent_run_id, json.dumps(event, indent=2, sort_keys=True, default=str), "trigger/asset_event.json")


def shard_set_dataset(shard_dir: str | os.PathLike):
    """(MLflow dataset, manifest sha256) for a shard set: name = version, digest = manifest sha256 (MLflow keeps
    36 characters), source = the shard directory."""
    import warnings

    import numpy as np
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types.schema import Schema, TensorSpec

    from data_prep.manifest import digest, load_manifest

    shard_dir = Path(shard_dir)
    m, sha = load_manifest(shard_dir), digest(shard_dir)
    with warnings.catch_warnings():  # the local artifact source is registered twice ("file" and ""): same class
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(shard_dir.as_uri())
    schema = Schema([TensorSpec(np.dtype(m["dtype"]), (-1, m["sample_tokens"]), "tokens")])
    return MetaDataset(source=source, name=m["version"], digest=sha[:32], schema=schema), sha


def finish_parent_run(
    cfg: PipelineConfig,
    dag_id: str,
    run_id: str,
    success: bool,
    started_at=None,
    ended_at=None,
    reason: str = "",
    shard_dir: str | None = None,
) -> str | None:
    """End a DAG run's parent run: FINISHED or FAILED as the DAG run ended, its duration (metric
    `pipeline.duration_s`, and the run's end time), and the shard set it used as the parent's dataset input."""
    import datetime as dt

    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    _, client, exp_id = _configure(cfg)
    parent = _find_parent(client, exp_id, dag_id, run_id)
    if parent is None:  # no stage reached MLflow (e.g. refused Params): nothing to end
        return None
    pid = parent.info.run_id
    now = dt.datetime.now(dt.timezone.utc)
    ended_at = ended_at or now
    started = started_at.timestamp() if started_at else parent.info.start_time / 1000
    duration = max(0.0, ended_at.timestamp() - started)
    client.log_metric(pid, "pipeline.duration_s", round(duration, 3))
    client.set_tag(pid, "pipeline.outcome", "success" if success else "failed")
    if reason:
        client.set_tag(pid, "pipeline.end_reason", str(reason)[:5000])
    if shard_dir and (Path(shard_dir) / "manifest.json").is_file():
        have = {d.dataset.digest for d in client.get_run(pid).inputs.dataset_inputs}
        dataset, sha = shard_set_dataset(shard_dir)
        if dataset.digest not in have:
            client.log_inputs(
                pid,
                datasets=[
                    DatasetInput(
                        dataset._to_mlflow_entity(),
                        tags=[InputTag(MLFLOW_DATASET_CONTEXT, "training"), InputTag("manifest_sha256", sha)],
                    )
                ],
            )
    client.set_terminated(pid, status="FINISHED" if success else "FAILED", end_time=int(ended_at.timestamp() * 1000))
    return pid


@contextlib.contextmanager
def stage_run(
    cfg: PipelineConfig,
    stage: str,
    parent_run_id: str | None = None,
    tags: dict | None = None,
    run_dir: Path | None = None,
):
    """Start (and end) the MLflow child run of one stage; yields the run id, or None with tracking off. When the
    server is gone at the end, the run's status and end time wait in <run_dir>/tracking-pending.json (flush_pending
    sets them once it answers, after the metrics that were pending before them).

    The run gets the flattened config as params (`train.lr`, …) and, for a device stage, MLflow's system metrics
    (tasks.sysmetrics: CPU, memory, disk, network, GPU, and `system/npu_*` from npu-smi)."""
    if not cfg.tracking.enabled or not is_rank0() or cfg.hardware.node_rank != 0:
        yield None  # one MLflow run per stage: node 0's
        return
    from tasks import sysmetrics

    mlflow, client, exp_id = _configure(cfg)
    all_tags = {
        "pipeline.stage": stage,
        "pipeline.kind": "stage",
        "git.sha": git_sha(),
        "config.hash": cfg.digest(),
        **(tags or {}),
    }
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
        parent = client.get_run(parent_run_id)
        for k in ("airflow.dag_id", "airflow.run_id"):
            if k in parent.data.tags:
                all_tags[k] = parent.data.tags[k]
    run = mlflow.start_run(run_name=stage, tags=all_tags, log_system_metrics=False)  # ours: sysmetrics below
    status = "FAILED"
    monitor = None
    _STAGE.update(run_dir=Path(run_dir) if run_dir is not None else None, uri=tracking_uri(cfg), down=False)
    try:
        with best_effort("the config as params"):
            log_params(config_params(cfg))
        with best_effort("system metrics"):
            monitor = sysmetrics.start(cfg, stage, run.info.run_id, tracking_uri(cfg))
        yield run.info.run_id
        status = "FINISHED"
    finally:
        _STAGE.clear()
        if monitor is not None:
            with best_effort("the last system metrics"):
                monitor.finish()
        import time as _time

        ended = int(_time.time() * 1000)
        try:
            mlflow.end_run(status)
        except Exception as e:  # server gone since the start: the stage's own outcome stands
            if run_dir is not None:
                defer(run_dir, {"uri": tracking_uri(cfg), "run_id": run.info.run_id, "status": status, "end_ms": ended})
            _warn(
                f"could not mark MLflow run {run.info.run_id} {status} ({_short(e)}); "
                + (f"sent by `python -m tasks.tracking flush --run-dir {run_dir}`" if run_dir else "it stays RUNNING")
            )


# The stage run being logged to (stage_run): its run directory and tracking URI, and whether MLflow failed during it.
_STAGE: dict = {}


def _during_stage(what: str, entry, call) -> None:
    """An MLflow call made while a stage works (its figures, params, artifacts, tags). MLflow failing here is a
    warning, never the stage's failure: the value waits in <run-dir>/tracking-pending.json (`entry()`, None: nothing
    that can wait) for the next stage or `python -m tasks.tracking flush`, and the stage's later calls wait there
    at once instead of on a dead server. Outside a stage run (no run directory) the error is the caller's."""
    run_dir = _STAGE.get("run_dir")
    if run_dir is None:
        return call()
    first = None
    if not _STAGE.get("down"):
        try:
            return call()
        except Exception as e:
            if refused(e):  # MLflow answered, and says no (e.g. a param changed): sending it later cannot help
                _warn(f"MLflow refused the stage's {what} ({_short(e)}); not logged")
                return None
            _STAGE["down"] = True
            first = e
    pending, run_id = entry() if entry else None, active_run_id()
    kept = "not kept (it cannot wait)"
    if pending is not None and run_id:
        try:
            defer(run_dir, {"uri": _STAGE["uri"], "run_id": run_id, **pending})
            kept = f"kept in {Path(run_dir) / PENDING}"
        except OSError as o:
            kept = f"not kept either ({o.strerror})"
    if first is not None:
        _warn(
            f"MLflow failed during the stage ({_short(first)}): {what} {kept}, and so are the stage's later values "
            f"(sent by the next stage or `python -m tasks.tracking flush --run-dir {run_dir}`)"
        )
    elif pending is None:
        _warn(f"{what} not logged to MLflow (down since earlier in the stage); {kept}")
    return None


# MLflow's answers that refuse a request for good (mlflow/protos/databricks.proto): it is not down, and the same
# request sent again later is refused again. Not BAD_REQUEST: MLflow's SQL store also says it for a broken database
# (mlflow/store/db/utils.py, any SQLAlchemyError but OperationalError), which may be mended.
REFUSALS = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"}


def refused(e: BaseException) -> bool:
    return getattr(e, "error_code", None) in REFUSALS


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}"


def _warn(msg: str) -> None:
    log.warning(f"tracking: {msg}")


@contextlib.contextmanager
def best_effort(what: str):
    """MLflow calls after the work is done (final metrics, tags, artifacts): an outage is a warning, never the
    stage's failure."""
    try:
        yield
    except Exception as e:
        _warn(f"{what} not logged to MLflow ({_short(e)})")


def _metric_batches(records: list[dict], prefix: str, have: set[int], timestamp_ms: int):
    from mlflow.entities import Metric

    batch = []
    for r in records:
        if r["step"] in have:
            continue
        for k, v in r.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                batch.append(
                    Metric(
                        metric_key(k, prefix), float(v), int(r.get("time", 0) * 1000) or timestamp_ms, int(r["step"])
                    )
                )
                if len(batch) == 900:  # log_batch takes at most 1000 metrics
                    yield batch
                    batch = []
    if batch:
        yield batch


def backfill_metrics(
    uri: str, run_id: str, metrics_path: str | os.PathLike, prefix: str = "train", key: str = "loss"
) -> int:
    """Send every step of metrics.jsonl that MLflow lacks (by the history of `metric_key(key, prefix)`); returns
    how many steps were sent. Raises when the server is still unreachable (the caller keeps it pending)."""
    import time as _time

    import mlflow

    bound_http()
    prefix = prefix.rstrip(".")  # pending entries written before the keys were split by `metric_key`
    records = read_jsonl(metrics_path)
    if not records:
        return 0
    client = mlflow.MlflowClient(uri)
    have = {m.step for m in client.get_metric_history(run_id, metric_key(key, prefix))}
    missing = [r for r in records if r["step"] not in have]
    for batch in _metric_batches(missing, prefix, set(), int(_time.time() * 1000)):
        client.log_batch(run_id, metrics=batch, synchronous=True)
    return len(missing)


def defer(run_dir: Path, entry: dict) -> None:
    """Append what MLflow could not take now to <run-dir>/tracking-pending.json (in order: flush_pending replays it)."""
    from tasks.fsutil import atomic_write_json, read_json

    path = Path(run_dir) / PENDING
    pending = read_json(path) if path.is_file() else []
    if entry not in pending:
        atomic_write_json(path, pending + [entry])


def _keep(run_dir: Path, uri: str, run_id: str | None, entry: dict, what: str, e: Exception) -> None:
    """An MLflow call that failed after the work was done: its entry kept pending (flush_pending sends it before the
    run's status) and one warning. A full or read-only disk is said, never raised: the stage's own cause must
    surface."""
    kept = f"kept in {Path(run_dir) / PENDING}"
    try:
        if run_id:
            defer(run_dir, {"uri": uri, "run_id": run_id, **entry})
    except OSError as o:
        kept = f"not kept either ({o.strerror})"
    _warn(f"{what} not logged to MLflow ({_short(e)}); {kept}")


def log_final_metrics(run_dir: Path, uri: str, metrics: dict) -> None:
    """A stage's closing figures (after the work is done): sent now, or kept pending with the run's status."""
    run_id = active_run_id()
    try:
        log_metrics(metrics)
    except Exception as e:
        clean = {sanitize_key(k): float(v) for k, v in _flatten(metrics).items() if _is_number(v)}
        _keep(run_dir, uri, run_id, {"final": clean}, "final metrics", e)


def set_tags_or_defer(run_dir: Path, uri: str, tags: dict, what: str) -> None:
    """Tags the run's readers rely on (pipeline.status, pipeline.error): sent now, or kept pending (flush_pending
    sets them before the run's status), so a flushed run is never FINISHED without them."""
    run_id = active_run_id()
    try:
        set_tags(tags)
    except Exception as e:
        _keep(run_dir, uri, run_id, {"tags": {k: str(v) for k, v in tags.items()}}, what, e)


def log_artifacts_or_defer(
    run_dir: Path, uri: str, files: list[tuple[Path, str | None]], tables: dict[str, dict], what: str
) -> None:
    """A stage's closing artifacts — files already in the run directory, and small tables ({artifact file:
    columns}) — sent now, or kept pending (flush_pending uploads them before the run's status)."""
    run_id = active_run_id()
    try:
        for name, columns in tables.items():
            log_table(columns, name)
        for path, artifact_path in files:
            log_artifact(path, artifact_path)
    except Exception as e:
        entry = {
            "files": [[str(p), a] for p, a in files],
            # [name, [[column, values], …]]: JSON objects are written with sorted keys, columns keep order
            "tables": [[k, [list(c) for c in v.items()]] for k, v in tables.items() if any(v.values())],
        }
        _keep(run_dir, uri, run_id, entry, what, e)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def settle_metrics(run_dir: Path, uri: str, run_id: str, metrics_path, prefix: str = "train") -> None:
    """At stage end: backfill what the trainer's asynchronous sender could not send; when MLflow is down, record
    it in <run-dir>/tracking-pending.json for the next stage (flush_pending) and warn, never fail."""
    try:
        backfill_metrics(uri, run_id, metrics_path, prefix)
    except Exception as e:
        defer(run_dir, {"uri": uri, "run_id": run_id, "metrics": str(metrics_path), "prefix": prefix})
        _warn(
            f"MLflow unreachable at the end of the stage ({_short(e)}); every step is in {metrics_path} and is "
            f"sent by the next stage (or `python -m tasks.tracking flush --run-dir {run_dir}`)"
        )


def _replay(entry: dict) -> int:
    """One pending entry: per-step metrics (metrics.jsonl), final metrics, tags, artifacts, or the run's end status.
    Returns steps."""
    import mlflow

    if "metrics" in entry:
        return backfill_metrics(entry["uri"], entry["run_id"], entry["metrics"], entry["prefix"])
    bound_http()
    client = mlflow.MlflowClient(entry["uri"])
    if "final" in entry:
        from mlflow.entities import Metric

        import time as _time

        now = int(_time.time() * 1000)
        step = int(entry.get("step", 0))
        client.log_batch(
            entry["run_id"], metrics=[Metric(k, v, now, step) for k, v in entry["final"].items()], synchronous=True
        )
    if "params" in entry:
        from mlflow.entities import Param

        out = _new_params(client.get_run(entry["run_id"]).data.params, entry["params"])
        if out:
            client.log_batch(entry["run_id"], params=[Param(k, v) for k, v in out.items()], synchronous=True)
    for name, text in entry.get("texts", []):
        client.log_text(entry["run_id"], text, name)
    for key, value in entry.get("tags", {}).items():
        client.set_tag(entry["run_id"], key, value)
    for name, columns in entry.get("tables", []):
        client.log_table(entry["run_id"], data=dict(columns), artifact_file=name)
    for path, artifact_path in entry.get("files", []):
        if Path(path).exists():  # a file removed since (the run directory tidied by hand) has nothing left to send
            log = client.log_artifacts if Path(path).is_dir() else client.log_artifact
            log(entry["run_id"], path, artifact_path)
    if "status" in entry:
        client.set_terminated(entry["run_id"], status=entry["status"], end_time=entry.get("end_ms"))
    return 0


def flush_pending(run_dir: Path) -> int:
    """Send what earlier stages could not (metrics, final metrics, tags, artifacts, run status), in the order it was
    left; entries that still fail stay pending, and so does everything after them for the same run (its status comes
    last). Returns steps sent."""
    from tasks.fsutil import atomic_write_json, read_json

    path = Path(run_dir) / PENDING
    if not path.is_file():
        return 0
    sent, left, stuck = 0, [], set()
    for entry in read_json(path):
        if entry["run_id"] in stuck:
            left.append(entry)
            continue
        try:
            sent += _replay(entry)
        except Exception as e:
            if refused(e):  # kept, it would hold this run's later entries (its status) back for ever
                _warn(f"MLflow refused a pending entry for run {entry['run_id']} ({_short(e)}); dropped")
                continue
            left.append(entry)
            stuck.add(entry["run_id"])
            what = entry.get("metrics") or (
                "final metrics"
                if "final" in entry
                else "params"
                if "params" in entry
                else f"tags {entry['tags']}"
                if "tags" in entry
                else f"artifacts {[p for p, _ in entry['files']] + [t for t, _ in entry['tables']]}"
                if "files" in entry
                else f"artifacts {[n for n, _ in entry['texts']]}"
                if "texts" in entry
                else f"status {entry.get('status')}"
            )
            _warn(f"still cannot send {what} to MLflow run {entry['run_id']} ({_short(e)})")
    if left:
        atomic_write_json(path, left)
    else:
        path.unlink(missing_ok=True)
    return sent


def main(argv=None) -> int:
    """`python -m tasks.tracking flush --run-dir D`: send what an MLflow outage left pending."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tasks.tracking", description=main.__doc__)
    p.add_argument("command", choices=["flush"])
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    n = flush_pending(Path(args.run_dir))
    left = (Path(args.run_dir) / PENDING).is_file()
    print(f"sent {n} steps to MLflow" + ("; some remain pending (MLflow unreachable)" if left else ""))
    return 1 if left else 0


def active_run_id() -> str | None:
    if "mlflow" not in sys.modules:  # no run can be active: skips mlflow's ~1.5 s import (--no-tracking)
        return None
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None


def active_experiment_id() -> str | None:
    if "mlflow" not in sys.modules:
        return None
    import mlflow

    run = mlflow.active_run()
    return run.info.experiment_id if run else None


def log_params(params: dict) -> None:
    """Params on the active run (values cut to MLflow's limit with a marker). MLflow refuses to change a param:
    a key the run already holds with another value (a stage's resolved `parallel.dp` beside the config's 0 =
    "planner decides") is logged as `<key>.resolved` instead of failing the stage."""
    run_id = active_run_id() if is_rank0() else None
    if run_id is None:
        return
    import mlflow

    flat = {sanitize_key(k): param_value(v) for k, v in _flatten(params).items()}

    def call():
        out = _new_params(mlflow.MlflowClient().get_run(run_id).data.params, flat)
        if out:
            mlflow.log_params(out)

    _during_stage("params", lambda: {"params": flat}, call)


def _new_params(have: dict, flat: dict) -> dict:
    """The params of `flat` the run lacks; a key it holds with another value as `<key>.resolved`."""
    out = {}
    for k, v in flat.items():
        if k in have and have[k] != v:
            k = sanitize_key(f"{k}.resolved")
        if have.get(k) != v:
            out[k] = v
    return out


def metric_key(name: str, prefix: str = "train") -> str:
    """A trainer figure's MLflow key: the headline ones (loss, val.loss, tokens_per_s) `train/<name>` so the UI
    shows them first, the others `train.<name>`."""
    return f"{prefix}/{name}" if name in HEADLINE else f"{prefix}.{name}"


def log_metrics(metrics: dict, step: int | None = None) -> None:
    if not is_rank0() or active_run_id() is None:
        return
    import mlflow

    clean = {
        sanitize_key(k): float(v)
        for k, v in _flatten(metrics).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if clean:
        _during_stage(
            "metrics",
            lambda: {"final": clean, **({"step": int(step)} if step is not None else {})},
            lambda: mlflow.log_metrics(clean, step=step),
        )


def log_artifact(path: str | os.PathLike, artifact_path: str | None = None) -> None:
    if not is_rank0() or active_run_id() is None:
        return
    import mlflow

    p = Path(path)
    _during_stage(
        f"artifact {p.name}",
        lambda: {"files": [[str(p), artifact_path]], "tables": []},
        lambda: (mlflow.log_artifacts if p.is_dir() else mlflow.log_artifact)(str(p), artifact_path),
    )


def log_json_artifact(obj, name: str) -> None:
    if not is_rank0() or active_run_id() is None:
        return
    import mlflow

    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    _during_stage(f"artifact {name}", lambda: {"texts": [[name, text]]}, lambda: mlflow.log_text(text, name))


def log_table(columns: dict[str, list], name: str) -> None:
    """A table artifact (MLflow's log_table: the UI shows it as a table, `mlflow.load_table` reads it back)."""
    if not is_rank0() or active_run_id() is None or not any(columns.values()):
        return
    import mlflow

    _during_stage(
        f"table {name}",
        lambda: {"files": [], "tables": [[name, [list(c) for c in columns.items()]]]},
        lambda: mlflow.log_table(data=columns, artifact_file=name),
    )


def log_figure(fig, name: str) -> None:
    if not is_rank0() or active_run_id() is None:
        return
    import mlflow

    _during_stage(f"figure {name}", None, lambda: mlflow.log_figure(fig, name))


def set_tags(tags: dict) -> None:
    if not is_rank0() or active_run_id() is None:
        return
    import mlflow

    clean = {k: str(v) for k, v in tags.items()}
    _during_stage("tags", lambda: {"tags": clean}, lambda: mlflow.set_tags(clean))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


if __name__ == "__main__":
    raise SystemExit(main())
