"""run_stage(): the one path from a config to a stage result, shared by the CLI and the Airflow tasks."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tasks import tracking
from tasks.config import PipelineConfig, repo_path, var_dir
from tasks.errors import ConfigError, StageError, os_error_cause
from tasks.fsutil import atomic_write_json, atomic_write_text, make_dirs, read_json, set_umask
from tasks.procs import RunDirLock, freeze_long_lived, skip_exit_collection
from tasks.stages import OWN_SCHEDULE, STAGES


# A Kubernetes Job's pod is told its job's name and its Airflow task's try (tasks.launch.k8s_job.render): the name is
# stamped into the stage's result (_k8s_stamp), the try tags the stage's MLflow child run (tasks/cli.py tracking_home).
JOB_ENV, TRY_ENV = "LLM_PIPELINE_K8S_JOB", "LLM_PIPELINE_TRY_NUMBER"

log = logging.getLogger("tasks.runner")


@dataclass
class StageContext:
    run_dir: Path
    stage: str
    args: argparse.Namespace = field(default_factory=argparse.Namespace)
    inputs: dict = field(default_factory=dict)  # earlier stages' results, by stage name
    mlflow_run_id: str | None = None
    parent_run_id: str | None = None


def stage_module(stage: str):
    if stage not in STAGES and stage not in OWN_SCHEDULE:
        raise StageError(
            f"unknown stage {stage!r} (stages: {', '.join(STAGES)}); on its own schedule: {', '.join(OWN_SCHEDULE)}"
        )
    return importlib.import_module({**STAGES, **OWN_SCHEDULE}[stage])


def add_shard_dir_arg(
    parser: argparse.ArgumentParser, purpose: str = "to read", default: str = "the shard stage's result in --run-dir"
) -> None:
    """--shard-dir (alias --shards): the same flag on every stage that reads the shard set."""
    parser.add_argument(
        "--shard-dir",
        "--shards",
        dest="shard_dir",
        default=None,
        metavar="DIR",
        help=f"shard set {purpose} (default: {default})",
    )


def flag_path(p: str) -> Path:
    """A path given as a command-line flag (--shard-dir, like --run-dir and --model-dir): relative to the working
    directory, where the user typed it (config values are the repository's: tasks.config.repo_path)."""
    return Path(p).expanduser().absolute()


def shard_dir(ctx: "StageContext", fallback: str | None = None, recorded: str | None = None) -> Path:
    """The shard set a stage reads: --shard-dir, else `recorded` (the set an earlier stage's own record names, which
    this stage must read too), else the shard stage's result in this run directory, else `fallback`; it must hold a
    manifest.json."""
    flag = getattr(ctx.args, "shard_dir", None)
    given = flag or recorded or ctx.inputs.get("shard", {}).get("shard_dir") or fallback
    if not given:
        raise StageError(
            f"{ctx.stage}: no shard set: run `python -m tasks shard` with this --run-dir first, or pass --shard-dir DIR"
        )
    path = flag_path(flag) if flag else repo_path(given)
    if not (path / "manifest.json").is_file():
        raise StageError(f"{ctx.stage}: {path} is not a shard set (no manifest.json)")
    return path


FROM_SHARD_SET = ("data.seq_len", "data.vocab_size")  # what a stage reading a shard set takes from its manifest


def shard_set(
    cfg: PipelineConfig, ctx: "StageContext", fallback: str | None = None, recorded: str | None = None
) -> Path:
    """shard_dir(), and the config made to agree with it: data.seq_len (and data.vocab_size, the BPE size the set
    was trained for) come from the manifest unless the caller set a different value explicitly (cfg.explicit):
    that is one ConfigError line, since the model would train on windows of another length than asked."""
    from data_prep.errors import DataPrepError
    from data_prep.manifest import load_manifest

    path = shard_dir(ctx, fallback, recorded)
    try:
        manifest = load_manifest(path)
    except DataPrepError as e:
        raise ConfigError(f"shards: {e}") from None
    wanted = {FROM_SHARD_SET[0]: manifest["seq_len"]}
    if manifest["tokenizer"].get("source") == "train" and "vocab_size" in manifest.get("config", {}):
        wanted[FROM_SHARD_SET[1]] = manifest["config"]["vocab_size"]  # with a given tokenizer it does not apply
    problems = []
    for dotted, value in wanted.items():
        section, _, key = dotted.partition(".")
        mine = getattr(getattr(cfg, section), key)
        if mine == value:
            continue
        if dotted in cfg.explicit:
            problems.append(
                f"{dotted}: {mine} differs from the shard set's {value} ({path}); leave it unset to "
                f"use the shard set's, or build a shard set with it"
            )
        else:
            setattr(getattr(cfg, section), key, value)
    # A stage reads the set as built (only the shard stage builds one, and it does not read through here): a data.*
    # value that decides another set's contents would be ignored here, and remembered as the run's.
    problems += _read_set_problems(cfg, ctx.stage, path, manifest)
    if problems:
        raise ConfigError(problems)
    return path


def _read_set_problems(cfg: PipelineConfig, stage: str, path: Path, manifest: dict) -> list[str]:
    """One line for each data.* key set explicitly (--set, Params, the run directory's remembered values) that decides
    what a set holds and differs from the set `stage` reads: only the shard stage builds a set, so the value would
    do nothing here, while MLflow and cli-config.json recorded it as this run's data."""
    problems = []
    for dotted in sorted(k for k in cfg.explicit if k.startswith("data.") and k not in FROM_SHARD_SET):
        key = dotted.partition(".")[2]
        if key in BUILD_ONLY or key == "shard_multiple":  # how a set is cut up, not what it holds
            continue
        shown = differing_value(cfg, key, manifest)
        if shown:
            problems.append(
                f"{dotted}: {shown[0]} differs from the shard set {stage} reads ({shown[1]}: {path}); only the shard "
                f"stage builds a set: rerun `python -m tasks shard` with it (then {stage}), or leave it unset"
            )
    return problems


def verified(cfg: PipelineConfig, shard_dir: Path, split: str, why: str) -> None:
    """With data.verify_sha256 (on in the DAG), every shard of `split` hashed against the manifest before a stage
    reads it (`why`: what for): a shard of the right size with altered bytes is one ConfigError line, not data the
    stage calibrates or scores on. The loader's crc32 catches a torn sample only, not an altered tar header."""
    if not cfg.data.verify_sha256:
        return
    from data_prep.errors import DataPrepError
    from data_prep.manifest import check_files, load_manifest

    try:
        check_files(shard_dir, load_manifest(shard_dir), split, sha256=True)
    except DataPrepError as e:
        raise ConfigError(f"shards ({split} split, {why}): {e}") from None


def default_args(stage: str) -> argparse.Namespace:
    """The stage's own flags at their defaults (what an Airflow task gets)."""
    parser = argparse.ArgumentParser()
    add = getattr(stage_module(stage), "add_cli_args", None)
    if add:
        add(parser)
    return parser.parse_args([])


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "run"


def default_run_dir(*parts: str) -> Path:
    """var/runs/<part>/…: one directory per DAG run (dag id / run id) or per CLI invocation (cli-<time>)."""
    from data_prep.errors import DataPrepError

    parts = parts or (time.strftime("cli-%Y%m%d-%H%M%S"),)
    try:  # a relative $LLM_PIPELINE_VAR_DIR: a config error (one line, not retried by the DAG's tasks), not a crash
        root = var_dir()
    except DataPrepError as e:
        raise ConfigError(str(e)) from None
    return root.joinpath("runs", *(safe_name(p) for p in parts))


def load_inputs(run_dir) -> dict:
    run_dir = Path(run_dir)
    inputs = {}
    for stage in STAGES:
        path = run_dir / f"{stage}.json"
        if path.is_file():
            inputs[stage] = read_json(path)
    return inputs


def run_stage(
    stage: str,
    cfg: PipelineConfig,
    run_dir: str | Path,
    args: argparse.Namespace | None = None,
    parent_run_id: str | None = None,
    tags: dict | None = None,
) -> dict:
    """Run one stage; write `<run_dir>/<stage>.json`; return the result (raises StageError on failure).

    `tags` go on the stage's MLflow run (a DAG without a parent run passes its dag/run ids here). A stage module
    may set `EXPERIMENT_SUFFIX` (its runs go to `<tracking.experiment><suffix>`) and `RUN_TAGS`."""
    module = stage_module(stage)
    set_umask()  # 0644 files, 0755 directories for the stage and its children, whatever the caller's umask
    freeze_long_lived()  # what the caller's process holds so far (Airflow, the stages before) out of later GC passes
    skip_exit_collection()
    if cfg.tracking.enabled:  # the registry name is refused by the first stage, not by evaluate after the whole run
        problem = tracking.model_name_problem(cfg.evaluate.registered_model)
        if problem:
            raise ConfigError(problem)
    check_relative_paths(cfg)
    suffix = getattr(module, "EXPERIMENT_SUFFIX", "")
    if suffix:
        import copy

        cfg = copy.deepcopy(cfg)
        cfg.tracking.experiment += suffix
    tags = {**getattr(module, "RUN_TAGS", {}), **(tags or {})}
    # absolute: torchrun's ranks start in the repository (tasks.launch.torchrun), so a relative --run-dir given from
    # anywhere else named files they could not find (train, profile: "rank 0 died … at step ?")
    run_dir = Path(run_dir).absolute()
    if run_dir.exists() and not run_dir.is_dir():
        raise StageError(f"--run-dir {run_dir} is a file, not a directory; choose another --run-dir")
    try:
        make_dirs(run_dir)
    except OSError as e:
        raise StageError(f"cannot create the run directory: {os_error_cause(e)}") from None
    args = args if args is not None else default_args(stage)
    started = time.time()
    # Every node of a multi-node job runs the stage in the shared run directory: node 0's result is the stage's.
    node = cfg.hardware.node_rank
    result_path = run_dir / (f"{stage}.json" if node == 0 else f"{stage}-node{node}.json")
    check_location(run_dir)
    try:
        lock = RunDirLock(run_dir, stage, node).__enter__()  # one writer per run directory (and node)
    except OSError as e:
        raise StageError(f"cannot lock the run directory: {os_error_cause(e)}") from None
    try:
        return _run_locked(module, stage, cfg, run_dir, args, parent_run_id, started, result_path, tags)
    finally:
        lock.__exit__(None, None, None)


LOCATION = ".run-dir"


def check_location(run_dir: Path) -> None:
    """Results inside a run directory name files by absolute path (checkpoints, hf/, quantize/, shards): a copied
    or moved run directory would silently use the original's artifacts. The directory records where it was
    created (`.run-dir`); used anywhere else it is refused in one line."""
    here = str(Path(run_dir).resolve())
    marker = Path(run_dir) / LOCATION
    try:
        recorded = marker.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        atomic_write_text(marker, here + "\n")
        return
    except OSError as e:
        raise StageError(f"cannot read {marker}: {os_error_cause(e)}") from None
    if recorded != here:
        raise StageError(
            f"run directory {here} was copied or moved from {recorded}: its results point at files "
            f"there; use a new --run-dir (or move it back to {recorded})"
        )


def _run_locked(
    module, stage, cfg, run_dir: Path, args, parent_run_id, started: float, result_path: Path, tags: dict
) -> dict:
    if cfg.tracking.enabled and (run_dir / tracking.PENDING).is_file():  # an earlier stage's MLflow outage
        tracking.flush_pending(run_dir)
    with tracking.stage_run(cfg, stage, parent_run_id, tags=tags, run_dir=run_dir) as run_id:
        ctx = StageContext(
            run_dir=run_dir,
            stage=stage,
            args=args,
            inputs=load_inputs(run_dir),
            mlflow_run_id=run_id,
            parent_run_id=parent_run_id,
        )
        before = _file_identity(result_path)
        try:
            result = module.run(cfg, ctx)
            if _file_identity(result_path) != before:
                raise StageError(
                    f"{stage}: the stage wrote {result_path}, the runner's result file (run() returns what goes "
                    f"there); write the stage's own outputs under {run_dir / stage}/"
                )
        except StageError as e:
            cause = _with_cann_logs(cfg, stage, run_dir, str(e), started, e)
            _record_failure(result_path, stage, cause, run_id, started)
            _tag_error(cfg, run_dir, run_id, cause)
            if cause != str(e):
                raise StageError(cause, retryable=e.retryable) from e
            raise
        except OSError as e:  # an environment fault (disk full, read-only, permissions): one line naming the path
            cause = os_error_cause(e)
            _record_failure(result_path, stage, cause, run_id, started, traceback.format_exc())
            _tag_error(cfg, run_dir, run_id, cause)
            raise StageError(cause) from e
        except Exception as e:  # a bug or an unexpected runtime error: still one line on top, trace in the file
            cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
            cause = _with_cann_logs(cfg, stage, run_dir, cause, started, e, full=str(e))
            _record_failure(result_path, stage, cause, run_id, started, traceback.format_exc())
            _tag_error(cfg, run_dir, run_id, cause)
            raise
        except BaseException as e:  # stopped from outside (Ctrl-C, Airflow's timeout or kill): said in the record too
            cause = _stopped_cause(stage, cfg, run_dir, e)
            _record_failure(result_path, stage, cause, run_id, started)  # local only: no MLflow call while stopping
            raise
        result = dict(result or {})
        result.setdefault("status", "ok")
        result.setdefault("summary", "")
        result.update(stage=stage, mlflow_run_id=run_id, seconds=round(time.time() - started, 2), **_k8s_stamp())
        if run_id:
            result["mlflow_experiment_id"] = tracking.active_experiment_id()
            tracking.set_tags_or_defer(
                run_dir, tracking.tracking_uri(cfg), {"pipeline.status": result["status"]}, "the stage status tag"
            )
    atomic_write_json(result_path, result)
    return result


def _stopped_cause(stage: str, cfg, run_dir: Path, e: BaseException) -> str:
    """The record of a stage stopped from outside. Airflow's execution_timeout (AirflowTaskTimeout, raised in the
    stage's process) recurs on a rerun under the same bound: name the bound and its key. A kill (Airflow's SIGTERM:
    AirflowTaskTerminated) or an interrupt (KeyboardInterrupt) does not: rerun. A SIGKILL leaves no record."""
    what = str(e).splitlines()[0] if str(e) else ""
    stopped = f"{stage}: stopped before it finished ({type(e).__name__}{': ' + what if what else ''})"
    if type(e).__name__ != "AirflowTaskTimeout":
        return f"{stopped}: killed or interrupted; rerun the stage"
    try:
        from tasks.bounds import stage_timeout

        seconds, how = stage_timeout(stage, cfg, run_dir)
        bound = f"its bound is {seconds} s ({how})"
    except (StageError, OSError, ValueError):  # while stopping: the record must still be written
        bound = "its bound is in the config's `timeouts` (tasks/bounds.py)"
    return (
        f"{stopped}: Airflow's execution_timeout; a rerun meets the same bound: {bound}; if it was only slow, "
        "raise it, else find where it hung in the log"
    )


def _file_identity(path: Path):
    """(inode, mtime) of `path`, or None when it does not exist: whether a stage wrote its own result file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _with_cann_logs(
    cfg, stage: str, run_dir: Path, cause: str, started: float, exc: BaseException, full: str = ""
) -> str:
    """CANN logs written during the stage → <run-dir>/<stage>/cann-logs/ (+ MLflow); a CANN/HCCL error code in the
    exception, the rank logs or those logs is named with its fix in the one-line cause."""
    from tasks.errors import ConfigError

    if isinstance(exc, ConfigError):
        return cause
    try:
        from tasks.envcheck import cann_logs

        text = f"{cause}\n{full}" if full else cause
        explained, _ = cann_logs.on_failure(cfg, stage, run_dir, text, started)
        return cause + explained[len(text) :]
    except Exception as e:  # the diagnosis must never hide the failure itself
        return f"{cause} (CANN log collection failed: {type(e).__name__}: {e})"


def _previous_result(path: Path) -> dict | None:
    """The last finished result the record at `path` holds (itself, or the one an earlier failure kept)."""
    try:
        old = read_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict):
        return None
    return old if old.get("status") in ("ok", "warn") else old.get("previous")


def _record_failure(path: Path, stage: str, cause: str, run_id, started: float, trace: str = "") -> None:
    """The failure record, keeping the stage's last finished result under `previous` (a failed rerun loses no
    completed record); when it cannot be written (the disk that failed the stage is full), say so on stderr and let
    the stage's own error propagate: the record's failure never hides the cause."""
    record = {
        "stage": stage,
        "status": "failed",
        "summary": cause,
        "error": cause,
        "mlflow_run_id": run_id,
        "seconds": round(time.time() - started, 2),
        "traceback": trace,
        **_k8s_stamp(),
    }
    if previous := _previous_result(path):
        record["previous"] = previous
    try:
        atomic_write_json(path, record)
    except OSError as e:
        log.warning(f"could not write the failure record ({os_error_cause(e)})")


def _k8s_stamp() -> dict:
    """In a Kubernetes Job's pod, the job's name (JOB_ENV, set by its manifest: tasks.launch.k8s_job.render) as
    `k8s_job`: the Airflow side takes only a result its own job wrote (k8s_job.collect_result), never an earlier
    try's."""
    job = os.environ.get(JOB_ENV, "").strip()
    return {"k8s_job": job} if job else {}


def _tag_error(cfg, run_dir: Path, run_id, cause: str) -> None:
    """The failed stage's one-line cause on its MLflow run: now, or pending (MLflow down) for the next flush."""
    if run_id:
        uri = tracking.tracking_uri(cfg)
        tags = {"pipeline.status": "failed", "pipeline.error": cause[:5000]}  # status: a filter on it finds failures
        tracking.set_tags_or_defer(run_dir, uri, tags, "the stage's error tag")


def data_inputs(paths: list[str]) -> list[str]:
    """data.inputs resolved as config paths are (repo_path: relative to the repository root); a relative one missing
    there but present in the working directory (where a user typed --set data.inputs=[corpus]) is one line naming
    both, not "does not exist"."""
    from data_prep.config import repo_input
    from data_prep.errors import DataPrepError

    try:
        return [repo_input(p) for p in paths]
    except DataPrepError as e:
        raise ConfigError(f"data.inputs: {e}") from None


def check_relative_paths(cfg: PipelineConfig) -> None:
    """data.tokenizer and model.hf_path are read as config paths are (repo_path): a relative one missing at the
    repository root but present in the working directory (`--set model.hf_path=my-model` typed beside it), or
    present in both as different things, is one line naming both, not "no tokenizer.json found" for a path the user
    never typed."""
    from data_prep.config import repo_input
    from data_prep.errors import DataPrepError

    given = {"data.tokenizer": "" if cfg.data.tokenizer == "train" else cfg.data.tokenizer}
    given["model.hf_path"] = cfg.model.hf_path
    for key, value in given.items():
        if value and not any(c in value for c in "*?["):  # not inputs: no glob is read as one
            try:
                repo_input(value)
            except DataPrepError as e:
                raise ConfigError(f"{key}: {e}") from None


def shard_multiple(cfg: PipelineConfig) -> int:
    """Readers per epoch = ranks × loader workers: the shard count is planned as a multiple of it."""
    if cfg.data.shard_multiple:
        return cfg.data.shard_multiple
    nproc = cfg.hardware.nproc_per_node
    if not nproc:
        from tasks.device import detect

        nproc = detect(cfg.hardware.device).device_count
    workers = cfg.data.loader_workers if cfg.data.loader_workers >= 0 else 4  # -1: sized per rank, at most 4
    return max(1, nproc * cfg.hardware.nnodes) * max(1, workers)


# data.* keys that only steer a build (how it is split up and shown), not what a set holds or how a run reads it: set
# beside --shard-dir they would do nothing. The other keys outside the set's config (data.out_dir: the disk checks';
# the loader's workers, prefetch and verify_sha256) still apply to a run that adopts a set.
BUILD_ONLY = ("partitions", "tokenize_processes", "progress")


def set_value(cfg: PipelineConfig, key: str, manifest: dict):
    """(this run's data.<key>, the shard set's) for a key that decides a set's contents, or None for one that
    does not. The set's come from its manifest: the build config it recorded (data_prep's cache key fields), its
    inputs and its tokenizer."""
    d, recorded = cfg.data, manifest.get("config", {})
    tok = manifest["tokenizer"]
    if key == "inputs":
        return (data_inputs(d.inputs), data_inputs(manifest["source"]["inputs"])) if "source" in manifest else None
    if key == "tokenizer":
        if d.tokenizer == "train" or tok["source"] == "train":
            shown = {"train": "train (a BPE trained on the corpus)"}
            return shown.get(d.tokenizer, d.tokenizer), shown.get(tok["source"], tok["source"])
        mine = tokenizer_identity(d.tokenizer)  # the same files under another path are the same tokenizer
        if mine == tok["identity"]:
            return mine, mine
        return f"{d.tokenizer} (identity {mine[:12]}…)", f"{tok['source']} (identity {tok['identity'][:12]}…)"
    if key == "vocab_size" and tok["source"] != "train":  # a given tokenizer keeps its own vocabulary
        return d.vocab_size, manifest["vocab_size"]
    if key == "shard_multiple":  # 0: automatic, as a build of this run would make it
        mine, theirs = shard_multiple(cfg), recorded.get(key, manifest.get("shard_multiple"))
        return (mine, theirs) if d.shard_multiple or mine == theirs else (f"0 (automatic: {mine})", theirs)
    if key in recorded:
        return getattr(d, key), recorded[key]
    return None


def differing_value(cfg: PipelineConfig, key: str, manifest: dict) -> tuple[str, str] | None:
    """(this run's data.<key>, the set's), as text, when the key decides a set's contents and the two differ."""
    pair = set_value(cfg, key, manifest)
    if pair is None or pair[0] == pair[1]:
        return None
    mine, theirs = (", ".join(map(str, v)) if isinstance(v, list) else str(v) for v in pair)
    return mine, theirs


def tokenizer_identity(spec: str) -> str:
    """The identity (data_prep.tokenizer.identity) a set built with tokenizer `spec` records: its tokenizer.json and
    companion files, as the build copies them in."""
    from data_prep.errors import DataPrepError
    from data_prep.fsio import sha256_file
    from data_prep.tokenizer import identity, tokenizer_companions, tokenizer_file

    path = str(repo_path(spec))
    try:
        files = {"tokenizer.json": sha256_file(tokenizer_file(path))}
        files.update({f.name: sha256_file(f) for f in tokenizer_companions(path)})
    except (DataPrepError, OSError) as e:
        raise ConfigError(f"data.tokenizer: {e}; leave it unset to adopt the set's own tokenizer") from None
    return identity(files)
