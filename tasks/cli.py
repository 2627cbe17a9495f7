"""`python -m tasks <stage> [--config F] [--set section.key=value …] [--run-dir D] [--json] [stage flags]`.

Also `python -m tasks summary --run-dir D` (the end-of-run table). Errors print one line and exit 2 (1: an internal
error, its traceback in <run-dir>/<stage>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from data_prep.errors import DataPrepError, OneLineParser
from tasks.errors import StageError, os_error_cause
from tasks.stages import OWN_SCHEDULE, STAGES

CLI_EXPERIMENT_SUFFIX = "-cli"


def tracking_home(cfg, run_dir) -> tuple[str | None, dict]:
    """(parent run id, tags) of a stage run started from the command line. In a DAG run's directory (a
    Kubernetes Job's pod, a rerun by hand: tasks.pipeline.DAG_RUN_FILE) it joins that DAG run's MLflow parent;
    anywhere else it goes to the experiment `<tracking.experiment>-cli`, so the pipeline's experiment lists the
    DAG runs only. A Kubernetes Job's pod is told its Airflow task's try (tasks.runner.TRY_ENV): tagged
    airflow.try_number, as a stage run on the Airflow worker is."""
    from tasks.fsutil import read_json
    from tasks.runner import TRY_ENV
    from tasks.pipeline import DAG_RUN_FILE

    tags = {"pipeline.origin": "cli"}
    if os.environ.get(TRY_ENV, "").strip():
        tags["airflow.try_number"] = os.environ[TRY_ENV].strip()
    marker = Path(run_dir) / DAG_RUN_FILE
    record = read_json(marker) if marker.is_file() else {}
    if record.get("parent_run_id"):
        return record["parent_run_id"], tags
    cfg.tracking.experiment += CLI_EXPERIMENT_SUFFIX
    return None, {**tags, "pipeline.run_dir": str(run_dir)}


def dag_run_config(run_dir: str | None, config: str | None, node: int = 0) -> tuple[str | None, dict | None]:
    """(preset, overrides) to load: --config when given, else the config of the DAG run whose directory --run-dir is
    (dag-run.json: its preset and Params; a rerun by hand must not register under the default preset's model name),
    else the config a CLI stage was given there (cli-config.json: its --config and --set values; the --set values
    also apply under the same --config), else the default preset. `node`: this stage run's hardware.node_rank (a
    killed run's pending values are taken by the same node only: pending_file())."""
    from tasks.fsutil import read_json
    from tasks.logs import log
    from tasks.pipeline import DAG_RUN_FILE

    here = run_dir and run_dir.strip()
    marker = Path(run_dir) / DAG_RUN_FILE if here else None
    recorded = (read_json(marker).get("config") if marker and marker.is_file() else None) or {}
    cli = Path(run_dir) / CLI_CONFIG_FILE if here else None
    remembered = (read_json(cli) if cli and cli.is_file() and not recorded.get("preset") else None) or {}
    pending = Path(run_dir) / pending_file(node) if here and not recorded.get("preset") else None
    unfinished = ""
    if pending and pending.is_file():  # left by a stage run that was killed (a train killed at step 200 of 300)
        remembered, cli = _read_or_none(pending) or remembered, pending
        unfinished = ": left by a stage run that did not finish, taken"
    sets = remembered.get("sets") or None
    given = f" with --set {' '.join(f'{k}={v}' for k, v in sets.items())}" if sets else ""
    if config is not None:
        if sets and _preset_id(config) != remembered.get("preset"):
            log.info(f"config: --config {config}; not this run directory's --set values (for another, in {cli})")
            return config, None
        if remembered.get("preset") and _preset_id(config) != remembered["preset"] and _loads(config):  # it rebound
            log.info(  # the directory unsaid (a --config that does not load is refused in its own line, no more)
                f"config: --config {config}, where this run directory's is {remembered['preset']} (from {cli}); once "
                f"this stage succeeds the directory's is {_preset_id(config)} (a later stage here without --config "
                "takes it)"
            )
        if unfinished or sets:  # the directory's --set values apply under its --config too: said, not silent
            log.info(f"config: --config {config}{given} (from {cli}{unfinished}); --set a key again to change it")
        return config, sets
    if not recorded.get("preset"):
        from tasks.config import DEFAULT_PRESET

        preset, env = remembered.get("preset") or None, os.environ.get("LLM_PIPELINE_PRESET")
        # the default preset with nothing else recorded is not worth a line, unless $LLM_PIPELINE_PRESET says another
        if preset and (preset != DEFAULT_PRESET or sets or unfinished or (env and env != preset)):
            not_env = f"; not $LLM_PIPELINE_PRESET's {env}" if env and env != preset else ""
            log.info(
                f"config: this run directory's ({preset}{given}, from {cli}{unfinished}){not_env}; --config to choose "
                "another"
            )
        elif not preset and here and env:  # not the default: said
            log.info(
                f"config: {env} (from $LLM_PIPELINE_PRESET): no --config and none recorded in {run_dir}; --config to "
                "choose another"
            )
        return preset, sets
    log.info(f"config: the DAG run's ({recorded['preset']} with its Params, from {marker}); --config to choose another")
    return recorded["preset"], recorded.get("overrides") or {}


# <run-dir>/cli-config.json: the --config and --set values `python -m tasks` stages were given there, which the next
# stage run in that directory takes (a run built with ci-tiny is evaluated as ci-tiny, not as the default preset; a
# train rerun after a kill keeps its --set train.steps). Rewritten once a stage accepted them (a new directory's
# first, before its first stage runs, so that a rerun of a failed first stage takes them too).
CLI_CONFIG_FILE = "cli-config.json"
# <run-dir>/cli-config.pending.json: the config a stage run is using (its --config and --set values), written just
# before the stage runs, moved to cli-config.json once it finished, removed when it failed or was refused. Left
# behind only by a run that was killed: the next stage run there takes it (`train --set train.steps=300`, killed,
# rerun as `train --run-dir D`: still 300), and says so.
PENDING_CONFIG_FILE = "cli-config.pending.json"


def pending_file(node: int) -> str:
    """The pending config's name for hardware.node_rank `node`: every node of a multi-node job runs its stage in the
    one shared run directory, and node 1's live pending values (its node rank among them) are no killed run's config
    for node 0. Node 0's is PENDING_CONFIG_FILE; node N's cli-config.pending-node<N>.json (as the runner's
    <stage>-node<N>.json). Only node 0 writes cli-config.json: the directory's config is node 0's."""
    return PENDING_CONFIG_FILE if node == 0 else f"cli-config.pending-node{node}.json"


def node_of(sets: list[str]) -> int:
    """hardware.node_rank as --set gives it (the way each node of a multi-node job is started; the last one wins),
    else 0: known before the config it helps choose is loaded. A bad value is load_config's to refuse."""
    from tasks.config import parse_sets

    value = parse_sets(sets).get("hardware.node_rank", "0").strip()
    return int(value) if value.isdigit() else 0


def result_file(stage: str, node: int) -> str:
    """The stage's result file as tasks.runner.run_stage writes it: node 0's <stage>.json, node N's
    <stage>-node<N>.json."""
    return f"{stage}.json" if node == 0 else f"{stage}-node{node}.json"


def _json_failure(args, stage: str, run_dir, node: int, cause: str) -> None:
    """--json: a failed or refused stage's result on stdout too (it printed nothing, and a script read an empty
    string): the failure record the runner wrote for this cause, else {stage, status, error}."""
    if not getattr(args, "json", False):
        return
    from tasks.fsutil import read_json

    path = Path(run_dir) / result_file(stage, node) if run_dir is not None else None
    try:
        record = read_json(path) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        record = {}
    if record.get("status") != "failed" or record.get("error") != cause:  # another run's, or refused before it ran
        record = {"stage": stage, "status": "failed", "error": cause}
    print(json.dumps(record, indent=2, default=str))


def _loads(config: str) -> bool:
    """--config names a preset file that loads (a bad one gets its own error line; nothing said before it)."""
    from tasks.config import ConfigError, load_yaml, resolve_preset

    try:
        load_yaml(resolve_preset(config))
    except ConfigError:
        return False
    return True


def _preset_id(config: str) -> str:
    """A preset name for a preset's own file (configs/ci-tiny.yaml is ci-tiny), else a file's absolute path (found
    from any cwd), else the name."""
    from tasks.config import CONFIG_DIR

    path = Path(config)
    if not path.is_file():
        return config
    if path.resolve().parent == CONFIG_DIR.resolve() and path.suffix == ".yaml":
        return path.stem
    return str(path.resolve())


def remember_config(run_dir: str | Path, config: str, sets: dict | None = None, name: str = CLI_CONFIG_FILE) -> None:
    from tasks.fsutil import atomic_write_json, make_dirs

    make_dirs(Path(run_dir))
    atomic_write_json(Path(run_dir) / name, {"preset": _preset_id(config), **({"sets": sets} if sets else {})})


def _read_or_none(path: Path) -> dict | None:
    from tasks.fsutil import read_json

    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def _drop_pending(pending: Path, left: dict | None) -> None:
    """This stage run's pending config is not the directory's (it failed or was refused): put back what a killed
    run had left there, else remove it."""
    from tasks.fsutil import atomic_write_json

    if left:
        atomic_write_json(pending, left)
    else:
        pending.unlink(missing_ok=True)


def refuse_early(cfg) -> None:
    """What the DAG's first task refuses (tasks.pipeline.early_problems: a converter name nothing
    registers, a blank evaluate.tasks entry), refused by every stage run from the command line before it does
    anything (an unknown model.preset, which tokenized a whole shard set before smoke refused it, is load_config's
    own refusal now: ModelConfig._registered_preset)."""
    from tasks.errors import ConfigError
    from tasks.pipeline import early_problems

    problems = early_problems(cfg)
    if problems:
        raise ConfigError(problems)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="preset name in configs/ or a YAML file (default: the one recorded in --run-dir, else "
        "$LLM_PIPELINE_PRESET, else demo-cpu)",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="extend",
        nargs="+",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override config values: --set a.b=1 c.d=2, or --set repeated (positional arguments go before --set); "
        "the keys, their defaults and ranges: tasks/config.py, data.* in data_prep/config.py (docs/configuration.md); "
        "a misspelt key names the nearest one",
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="where results go (default <var>/runs/cli-<time>; <var> = $LLM_PIPELINE_VAR_DIR or <repo>/var)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nstages: " + ", ".join([*STAGES, *OWN_SCHEDULE]) + ", summary")
        return 0
    stage = argv.pop(0)
    run_dir, node, args = None, 0, None
    from tasks.logs import console

    console()  # the stages' log lines (progress, warnings) on stderr
    try:
        from data_prep.config import var_dir

        var_dir()  # a relative $LLM_PIPELINE_VAR_DIR: refused before anything is written
        if stage == "summary":
            from tasks.summary import main as summary_main

            return summary_main(argv, run_config=dag_run_config)  # the run directory's config, as its stages took
        from tasks.config import load_config, parse_sets
        from tasks.runner import default_run_dir, run_stage, stage_module

        module = stage_module(stage)
        parser = OneLineParser(prog=f"python -m tasks {stage}", description=(module.__doc__ or "").strip())
        _common(parser)
        if hasattr(module, "add_cli_args"):
            module.add_cli_args(parser)
        args = parser.parse_args(argv)
        if args.config is not None and not args.config.strip():  # `--config ''` (an unset variable)
            raise StageError(
                "--config is empty: give a preset name or a YAML file, or leave --config out for the run directory's"
            )
        node = node_of(args.sets)
        preset, overrides = dag_run_config(args.run_dir, args.config, node)
        cfg = load_config(preset, overrides, sets=args.sets)
        refuse_early(cfg)  # before the run directory remembers anything
        node = cfg.hardware.node_rank
        if args.no_tracking:
            cfg.tracking.enabled = False
        if args.run_dir is not None and not args.run_dir.strip():  # `--run-dir ''` (an unset variable): not a new run
            raise StageError(
                "--run-dir is empty: give a directory, or leave --run-dir out for a new var/runs/cli-<time>"
            )
        run_dir = args.run_dir or default_run_dir()
        from tasks.launch.placement import runs_on_kubernetes

        if runs_on_kubernetes(stage, cfg):  # the DAG's routing, not the CLI's: said, never silently ignored
            print(
                f"note: hardware.launcher kubernetes sends the DAG's {stage} task to a Kubernetes Job; "
                "`python -m tasks` runs the stage here, on this machine (what each pod runs)",
                file=sys.stderr,
            )
        from tasks.pipeline import DAG_RUN_FILE

        # what this run directory remembers (cli-config.json; a DAG run's directory has its own): the preset
        # (--config, else $LLM_PIPELINE_PRESET: the next stage here must not fall back to demo-cpu) and --set values
        from tasks.config import DEFAULT_PRESET

        chosen = args.config or preset or os.environ.get("LLM_PIPELINE_PRESET") or DEFAULT_PRESET
        if Path(run_dir).exists() and not Path(run_dir).is_dir():  # before anything is remembered in it
            raise StageError(f"--run-dir {run_dir} is a file, not a directory; choose another --run-dir")
        try:  # as the runner would (its line), before anything is remembered in it
            from tasks.fsutil import make_dirs

            make_dirs(Path(run_dir))
        except OSError as e:
            raise StageError(f"cannot create the run directory: {os_error_cause(e)}") from None
        remember = not (Path(run_dir) / DAG_RUN_FILE).is_file()
        sets = {**(overrides or {}), **parse_sets(args.sets)} if remember else {}
        pending = Path(run_dir) / pending_file(node)
        left = _read_or_none(pending) if remember and pending.is_file() else None  # a killed run's, kept if refused
        if remember and node == 0 and not (Path(run_dir) / CLI_CONFIG_FILE).is_file():  # a new directory: a failed
            remember_config(run_dir, chosen, sets)  # first stage is rerun with it
        elif remember:  # taken by this node's next run if this one is killed; node 0's: cli-config.json once finished
            remember_config(run_dir, chosen, sets, name=pending.name)
        parent, tags = tracking_home(cfg, run_dir) if cfg.tracking.enabled else (None, {})
        try:
            result = run_stage(stage, cfg, run_dir, args=args, parent_run_id=parent, tags=tags)
        except (Exception, SystemExit):
            if remember:
                _drop_pending(pending, left)
            raise
        if remember and node == 0 and result.get("status") != "failed":  # a directory's config changes once a
            remember_config(run_dir, chosen, sets)  # stage accepted it
        if remember:
            _drop_pending(pending, left if result.get("status") == "failed" else None)
    except (StageError, DataPrepError) as e:
        print(f"error: {e}", file=sys.stderr)
        _json_failure(args, stage, run_dir, node, str(e))
        return 2
    except OSError as e:  # read-only/full/missing paths outside a stage (config file, var dir): one line
        print(f"error: {os_error_cause(e)}", file=sys.stderr)
        _json_failure(args, stage, run_dir, node, os_error_cause(e))
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: one line on top; the stage's traceback is in <run-dir>/<stage>.json
        first = str(e).splitlines()[0] if str(e) else ""
        where = f" (traceback in {run_dir}/{result_file(stage, node)})" if run_dir is not None else ""
        print(f"error: {stage}: {type(e).__name__}: {first}{where}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        where = f"{run_dir}/{result_file(stage, node)}"
        print(f"{stage}: {result.get('status')} — {result.get('summary', '')}  (results in {where})")
    return 0
