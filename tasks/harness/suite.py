"""evaluate.tasks → lm-eval tasks, loaded and checked before any model is (one line per problem), then scored.

An entry is a task, group or tag name known to lm-eval (e.g. `mmlu`, `ceval-valid`, `arc_easy`), a path to a task or
group YAML in lm-eval's own format (its folder joins TaskManager's include_path, so a YAML may name its siblings; a
group YAML is loaded by its `group:` name), or `demo-continuation` (tasks.harness.demo_task, written from the shard
set's val split). Nothing is fetched from a hub: Hugging Face datasets run offline and read what is on disk (the HF
datasets cache, or local files a task YAML names). Each entry's score is its first metric among evaluate.task_metrics (a
group: lm-eval's aggregate when the group defines one, else the mean of its tasks); the macro average is over the
entries.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from tasks.errors import StageError

# Before datasets / huggingface_hub are imported (they read these once): no download, ever, at run time.
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
SEEDS = (0, 1234, 1234, 1234)  # lm_eval.evaluator.simple_evaluate's defaults: random, numpy, torch, few-shot


def offline() -> None:
    os.environ.update(OFFLINE_ENV)
    import datasets.config

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()  # "Generating test split" bars on stderr would bury a stage's one-line cause
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task INFO/WARNING lines would flood stage logs
    quiet_request_bars()


def quiet_request_bars() -> None:
    """No tqdm bar while lm-eval builds a task's requests: tasks.harness.lm prints progress lines instead. lm-eval
    0.4.13 offers no switch for that bar (lm_eval/api/task.py, Task.build_all_requests: `tqdm(doc_id_docs,
    total=num_docs)`; lm_eval.evaluator.evaluate passes nothing that reaches it) and tqdm's own, TQDM_DISABLE, is read
    once when tqdm is imported (tqdm/utils.py, envwrap): the bar went to stderr, a stray "0/300" line in the stage's
    log (above a one-line cause when a task failed mid-build). The model's own bars are off through lm-eval's
    `disable_tqdm` (tasks.harness.lm)."""
    import functools

    import lm_eval.api.task
    from tqdm import tqdm

    lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)


def is_path(entry: str) -> bool:
    return entry.endswith((".yaml", ".yml")) or "/" in entry


@dataclass
class Suite:
    entries: dict[str, list[str]]  # evaluate.tasks entry → the lm-eval leaf task names it stands for
    names: dict[str, str]  # entry → display name (the task or group name; a YAML path's task name)
    groups: dict[str, str]  # entry → its group's name, where lm-eval aggregates it
    loaded: dict  # lm-eval TaskDict of every leaf task
    metric: dict[str, str]  # leaf task → the metric it is scored by
    limit: int | None
    fewshot: dict[str, int] = field(default_factory=dict)
    specs: dict[str, str] = field(default_factory=dict)  # entry → what lm-eval loaded (a name or a YAML's path)
    data_files: dict[str, list[str]] = field(default_factory=dict)  # leaf task → local files its YAML reads
    versions: dict[str, str] = field(default_factory=dict)  # leaf task → its version (YAML metadata)
    filters: dict[str, str] = field(default_factory=dict)  # leaf task → the filter its metric is read through


# lm-eval's own tasks too? → the last TaskManager of that kind, with its include folders and their YAML fingerprint
# (one of each: a long-lived worker that evaluates many run folders keeps one full index, not one per folder)
_MANAGERS: dict[bool, tuple[tuple, object]] = {}


def _manager(entries: list[str], extra_paths: list[Path]):
    """TaskManager over our own folders only (fast), with lm-eval's 10 000+ tasks indexed only when a name needs it:
    an entry's, or one a group YAML's `task:` list names (through the groups it names)."""
    folders = sorted({str(p.parent) for p in extra_paths})
    own = _task_manager(folders, defaults=False)
    members = [name for p in extra_paths for name in _members(own, str(p))]
    if all(e in own.all_tasks or is_path(e) for e in entries) and all(m in own.all_tasks for m in members):
        return own
    return _task_manager(folders, defaults=True)


def _group_name(spec: str) -> str | None:
    """The `group:` name of a group YAML, as lm-eval's index tells a group from a task (TaskIndex._kind_of: a `group`
    key and no `class`; includes merged); None for a task YAML."""
    cfg = _yaml(spec)
    name = cfg.get("group")
    return name if isinstance(name, str) and "class" not in cfg else None


def _members(tm, spec: str) -> list[str]:
    """The task, group and tag names a group YAML's `task:` list gives, and those of the groups it names that `tm`
    indexes (an inline subgroup's too); [] for a task YAML."""
    if _group_name(spec) is None:
        return []
    out: list[str] = []
    todo = [_yaml(spec)]
    while todo:
        listed = todo.pop().get("task")
        for item in listed if isinstance(listed, list) else []:
            if isinstance(item, dict) and isinstance(item.get("group"), str) and item["group"] not in tm.task_index:
                todo.append(item)  # an inline subgroup: its own task list
                continue
            name = item.get("task") or item.get("group") if isinstance(item, dict) else item
            if not isinstance(name, str) or name in out:
                continue
            out.append(name)
            found = tm.task_index.get(name)
            if found is not None and found.kind.name == "GROUP" and found.cfg:
                todo.append(found.cfg)
    return out


def _task_manager(folders: list[str], defaults: bool):
    """lm-eval's TaskManager, reused within this process while the task YAMLs of `folders` are what it indexed (same
    paths, same bytes): indexing lm-eval's own ~14 700 tasks parses every YAML (about 10 s of CPU on a 2-core host),
    and one process may load suites several times (quantize's gate and evaluate in one worker, tests). Only the
    index (names → YAML paths, groups, tags) is reused: TaskManager.load reads each task's YAML from disk again.
    lm-eval's own folder changes only with a reinstall."""
    from lm_eval.tasks import TaskManager

    seen = (tuple(folders), _fingerprint(folders))
    hit = _MANAGERS.get(defaults)
    if hit is not None and hit[0] == seen:
        return hit[1]
    tm = TaskManager(include_path=list(folders) or None, include_defaults=defaults)
    _MANAGERS[defaults] = (seen, tm)
    return tm


def _fingerprint(folders: list[str]) -> tuple:
    """Every task YAML lm-eval's index reads under `folders` (TaskIndex._iter_yaml_files: **/*.yaml) with a digest of
    its bytes: an added, removed or edited YAML changes it."""
    out = []
    for folder in folders:
        for path in sorted(Path(folder).glob("**/*.yaml")):
            try:
                out.append((str(path), hashlib.blake2b(path.read_bytes(), digest_size=16).digest()))
            except OSError:  # gone or unreadable now: the index skips it too
                out.append((str(path), None))
    return tuple(out)


def _fold(name: str) -> str:
    return name.lower().replace("-", "_")


def unknown_name(tm, entry: str) -> str:
    """The one line for an evaluate.tasks name that lm-eval's index `tm` does not know (load, check_names). Close
    matches are lm-eval's names and demo-continuation, compared with case and -/_ folded (`Demo_Continuation` is
    demo-continuation), a name that differs only so first."""
    from tasks.harness.demo_task import NAME

    folded: dict[str, list[str]] = {}
    for name in [NAME, *tm.all_tasks]:
        folded.setdefault(_fold(name), []).append(name)
    keys = difflib.get_close_matches(_fold(entry), list(folded), n=3)
    close = [name for key in keys for name in folded[key]][:3]
    return (
        f"evaluate.tasks: {entry!r} is not an lm-eval task, group or tag"
        + (f" (close: {', '.join(close)})" if close else "")
        + "; give a name from `lm-eval ls tasks` or the path of a task YAML"
    )


def yaml_file(entry: str) -> Path:
    """A YAML entry's file (a relative path is the repository's), else the one line (load, check_names)."""
    from tasks.config import repo_path

    path = repo_path(entry)
    if not path.is_file():
        here = Path.cwd() / entry
        raise StageError(
            f"evaluate.tasks: {entry}: no such task YAML file ({path}: a relative path is read from the repository"
            + (f"; {here} exists: give its absolute path)" if here.is_file() else "; give an absolute path)")
        )
    return path


def check_names(entries: list[str], defaults: bool = True) -> None:
    """evaluate.tasks checked by name only, no task built and no dataset read: every YAML path names a file and
    every other entry but demo-continuation is a name lm-eval's index knows (load's own two lines). The env stage's
    early check, so that a mistyped name stops the run at its first task, not at shard after tokenizing; load checks
    the rest. lm-eval's own ~14 700 tasks are indexed (about 7 s of CPU) only for a name the listed YAMLs' folders do
    not define; `defaults` False: those folders' tasks only."""
    paths = [yaml_file(e) for e in entries if e != "demo-continuation" and is_path(e)]
    names = [e for e in entries if e != "demo-continuation" and not is_path(e)]
    if not names:
        return
    tm = _manager(names, paths) if defaults else _task_manager(sorted({str(p.parent) for p in paths}), False)
    for name in names:
        if name not in tm.all_tasks:
            raise StageError(unknown_name(tm, name))


def _load_one(tm, entry: str, spec: str):
    """lm-eval's TaskDict of one entry. A group YAML is loaded by its group name, its folder on the include_path:
    lm-eval 0.4.13 loads a YAML path as a task named by its `task:` (TaskIndex.entry_from_path), which for a group is
    its list of tasks (TypeError: unhashable type: 'list')."""
    target = spec
    group = _group_name(spec) if is_path(entry) else None
    if group is not None and (found := tm.task_index.get(group)) is not None:  # not indexed: lm-eval says why
        where = Path(found.yaml_path).resolve() if found.yaml_path else None
        if where != Path(spec).resolve():
            raise StageError(
                f"evaluate.tasks: {entry}: lm-eval's index gives its group name {group!r} to {where or 'a tag'}, "
                "not to this file (one definition per name across the folders of evaluate.tasks' YAMLs); rename one "
                "of them"
            )
        target = group
    try:
        return tm.load([target])
    except KeyError as e:
        if is_path(entry):  # the file exists (load checked): a key its dataset lacks, e.g. a split
            problem = _split_problem(spec, e.args[0] if e.args else None)
            problem = problem or f"lm-eval rejects this task ({_first_line(e)})"
            raise StageError(f"evaluate.tasks: {entry}: {problem}") from None
        raise StageError(unknown_name(tm, entry)) from None
    except (FileNotFoundError, ConnectionError) as e:  # offline datasets: not in the cache / data_files missing
        lost_include = _include_problem(spec) if is_path(entry) else None
        if lost_include:  # the YAML's own chain, not its dataset
            raise StageError(f"evaluate.tasks: {entry}: {lost_include}") from None
        relative = [p for p in _relative_data_files(spec) if not Path(p).exists()] if is_path(entry) else []
        if relative:  # lm-eval passes data_files to datasets as they are: a relative path is the cwd's
            beside = Path(spec).parent / relative[0]
            raise StageError(
                f"evaluate.tasks: {entry}: dataset_kwargs.data_files {relative[0]!r} is a relative path, which "
                f"datasets reads from the current directory ({Path.cwd()}), not from the YAML's folder; write its "
                "absolute path" + (f" ({beside.resolve()} exists)" if beside.exists() else "")
            ) from None
        files = (_yaml(spec).get("dataset_kwargs") or {}).get("data_files") if is_path(entry) else None
        lost = [p for p in _paths(files) if "://" not in p and Path(p).is_absolute() and not Path(p).exists()]
        if lost:  # a local copy named in the YAML: not the HF cache's business
            raise StageError(
                f"evaluate.tasks: {entry}: dataset_kwargs.data_files {lost[0]} does not exist; write the path of the "
                "task's data file"
            ) from None
        raise StageError(
            f"evaluate.tasks: {entry}: its dataset is not on disk ({_first_line(e)}); nothing is downloaded at run "
            "time: fetch it once into the HF datasets cache on this host (datasets.load_dataset with the task's "
            "dataset_path/dataset_name, HF_DATASETS_CACHE), or write a task YAML whose dataset_kwargs.data_files "
            "names a local copy (docs/evaluation.md)"
        ) from None
    except Exception as e:  # noqa: BLE001 — lm-eval raises what its config and YAML readers raise
        problem = _column_problem(spec) if is_path(entry) else None  # lm-eval renders doc_to_choice on load
        raise StageError(
            f"evaluate.tasks: {entry}: {problem or f'lm-eval rejects this task ({_first_line(e)})'}"
        ) from None


def _include_problem(spec: str, seen: set | None = None) -> str | None:
    """An `include:` of the task YAML (or of a YAML it includes) that names no file; lm-eval reads it from the
    including YAML's folder (lm_eval/tasks/_yaml_loader.py, load_yaml). None when every include exists."""
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(spec).resolve()
    seen = seen if seen is not None else set()
    if path in seen:
        return None
    seen.add(path)
    try:
        includes = load_yaml(path, resolve_func=False, recursive=False).get("include")
    except Exception:  # noqa: BLE001 — lm-eval reports its own problem with this YAML
        return None
    for inc in includes if isinstance(includes, list) else [includes] if includes else []:
        target = Path(inc) if Path(str(inc)).is_absolute() else path.parent / str(inc)
        if not target.is_file():
            return (
                f"include: {inc!r} (in {path.name}) names no file ({target}: an include is read from the including "
                "YAML's folder); write the name of an existing YAML"
            )
        if problem := _include_problem(str(target), seen):
            return problem
    return None


def _column_problem(spec: str) -> str | None:
    """A bare doc_to_* name that is no column of the first row of the YAML's local JSON/JSONL data (lm-eval renders
    an unknown name as text, and a choice list made of it fails as a Python literal); None when unsure."""
    import json

    cfg = _yaml(spec)
    files = _local_files((cfg.get("dataset_kwargs") or {}).get("data_files"))
    if cfg.get("process_docs") or not files or not files[0].endswith((".json", ".jsonl")):
        return None
    try:
        with open(files[0], encoding="utf-8") as f:
            first = json.loads(f.readline()) if files[0].endswith(".jsonl") else json.load(f)
        first = first[0] if isinstance(first, list) else first
    except (OSError, ValueError, IndexError):
        return None
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        value = cfg.get(key)
        if isinstance(first, dict) and isinstance(value, str) and _COLUMN.match(value) and value not in first:
            columns = ", ".join(sorted(first))
            return f"{key} {value!r} is none of its columns ({columns}: {files[0]}); name a column or write a template"
    return None


def _yaml(spec: str) -> dict:
    """A task YAML as lm-eval's own loader reads it (includes merged, !function tags not imported); {} if it can't."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return load_yaml(spec, resolve_func=False)
    except Exception:  # noqa: BLE001 — lm-eval reports its own problem with this YAML
        return {}


def _relative_data_files(spec: str) -> list[str]:
    """The relative paths among a task YAML's dataset_kwargs.data_files."""
    files = (_yaml(spec).get("dataset_kwargs") or {}).get("data_files")
    return [p for p in _paths(files) if "://" not in p and not Path(p).is_absolute()]


def _split_problem(spec: str, key) -> str | None:
    """A task YAML's split its dataset lacks, and the splits it has: datasets names the one split of data_files given
    as a path or a list `train` (datasets.load_dataset), of a mapping its keys."""
    cfg = _yaml(spec)
    fields = [f for f in ("test_split", "validation_split", "training_split", "fewshot_split") if cfg.get(f) == key]
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if not fields or files is None:
        return None
    splits = sorted(files) if isinstance(files, dict) else ["train"]
    why = "" if isinstance(files, dict) else " (datasets calls the split of data_files given as a path or list 'train')"
    return (
        f"{fields[0]} {key!r} is not a split of its dataset, which has {', '.join(splits)}{why}; set {fields[0]}: "
        f"{splits[0]}, or name the split in data_files ({{{key}: PATH}})"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240]}" if text else type(e).__name__


def load(entries: list[str], demo_yaml: Path | None, limit: int | None, fewshot: dict, metrics: list[str]) -> Suite:
    """Load and check every entry (datasets read now, offline), before any model is loaded."""
    offline()
    specs = {}
    for entry in entries:
        if entry == "demo-continuation":
            specs[entry] = str(demo_yaml)
        elif is_path(entry):
            specs[entry] = str(yaml_file(entry))
        else:
            specs[entry] = entry
    tm = _manager(list(specs), [Path(s) for s in specs.values() if is_path(s)])
    loaded = {"tasks": {}, "groups": {}, "group_map": {}}
    suite = Suite({}, {}, {}, loaded, {}, limit, specs=specs)
    for entry, spec in specs.items():
        one = _load_one(tm, entry, spec)
        if not one["tasks"]:
            raise StageError(
                f"evaluate.tasks: {entry}: lm-eval finds no task in it"
                + (" (a group YAML lists its tasks, groups or tags under `task:`)" if is_path(entry) else "")
            )
        suite.entries[entry] = sorted(one["tasks"])
        tops = [g for g in one["groups"] if not any(g in kids for kids in one["group_map"].values())]
        suite.groups.update({entry: tops[0]} if len(tops) == 1 else {})
        suite.names[entry] = tops[0] if len(tops) == 1 else suite.entries[entry][0] if len(one["tasks"]) == 1 else entry
        for key in ("tasks", "groups", "group_map"):
            dup = set(loaded[key]) & set(one[key])
            if key == "tasks" and dup:
                raise StageError(f"evaluate.tasks: {entry}: task {sorted(dup)[0]} is already in another entry")
            loaded[key].update(one[key])
    for name, task in loaded["tasks"].items():
        suite.data_files[name] = _local_files((task.config.dataset_kwargs or {}).get("data_files"))
        suite.versions[name] = str(task.VERSION)
    _check_metrics(suite, metrics)
    _check_rows(suite)
    _check_greedy(suite)
    _apply_fewshot(suite, fewshot)
    return suite


_COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a bare name in doc_to_*: a column (else lm-eval renders it as text)


def _check_rows(suite: Suite) -> None:
    """Every evaluation row gives its task a target, and a multiple-choice task a list of choices the target indexes
    or is one of. lm-eval scores a target it cannot place as wrong with a warning (a misspelled doc_to_target column
    gave acc 0.000 and a passing gate) and fails on a row it cannot read only after the models are loaded."""
    for name, task in suite.loaded["tasks"].items():
        for i, doc in enumerate(task.eval_docs):
            problem = _row_problem(task, doc)
            if problem:
                raise StageError(f"evaluate.tasks: task {name}: row {i} of its evaluation split: {problem}")


def _row_problem(task, doc) -> str | None:
    columns = ", ".join(sorted(doc))
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        value = getattr(task.config, key, None)
        if task.prompt is None and isinstance(value, str) and _COLUMN.match(value) and value not in doc:
            return f"{key} {value!r} is none of its columns ({columns}); name a column or write a template"
    try:
        target = task.doc_to_target(doc)
        choices = task.doc_to_choice(doc) if task.OUTPUT_TYPE == "multiple_choice" else None
    except Exception as e:  # noqa: BLE001 — lm-eval's templates raise what Jinja and ast raise
        return f"lm-eval cannot read it ({_first_line(e)}); its columns: {columns}"
    if target is None or target == "":
        return f"its target is empty (doc_to_target {task.config.doc_to_target!r}; columns: {columns})"
    if task.OUTPUT_TYPE != "multiple_choice":
        return None
    if not isinstance(choices, list) or not choices:
        return f"doc_to_choice gives {choices!r}, not a list of choices (columns: {columns})"
    for gold in target if isinstance(target, list) else [target]:
        if not ((isinstance(gold, int) and 0 <= gold < len(choices)) or (isinstance(gold, str) and gold in choices)):
            return f"its target {gold!r} is neither an index below {len(choices)} nor one of its choices {choices!r}"
    return None


def _paths(data_files) -> list[str]:
    """Every path of a YAML's dataset_kwargs.data_files (a path, a list, or split → path(s))."""
    if isinstance(data_files, dict):
        return [p for v in data_files.values() for p in _paths(v)]
    items = data_files if isinstance(data_files, list) else [data_files] if data_files else []
    return [p for p in items if isinstance(p, str)]


def _local_files(data_files) -> list[str]:
    """The local files among a YAML's dataset_kwargs.data_files."""
    return sorted(p for p in _paths(data_files) if Path(p).is_file())


def _check_metrics(suite: Suite, metrics: list[str]) -> None:
    for name, task in suite.loaded["tasks"].items():
        reported = list(task._metric_fn_list)  # what process_results will report (set from the YAML's metric_list)
        chosen = next((m for m in metrics if m in reported), None)
        if chosen is None:
            raise StageError(
                f"evaluate.tasks: task {name} reports {', '.join(reported) or 'no metric'}, none of "
                f"evaluate.task_metrics ({', '.join(metrics)}); add one of them to evaluate.task_metrics"
            )
        # The gate's relative drop and the macro average read every score as higher-is-better: a perplexity would
        # read a worse INT8 as an improvement. lm-eval's own direction: the YAML's metric_list, else its registry.
        if task.higher_is_better().get(chosen) is False:
            raise StageError(
                f"evaluate.tasks: task {name} is scored by {chosen} (evaluate.task_metrics), for which lower is "
                "better; only higher-is-better metrics are gated: give a task reporting one (e.g. acc) or drop it"
            )
        suite.metric[name] = chosen
        # lm-eval reports each metric per filter ("exact_match,strict-match" for gsm8k's filter_list): "none" when
        # the task has that filter (no filter_list: take_first), else its YAML's first
        names = [f.name for f in getattr(task, "_filters", [])]
        suite.filters[name] = "none" if "none" in names or not names else names[0]


def _apply_fewshot(suite: Suite, fewshot: dict) -> None:
    """evaluate.num_fewshot: {entry, group or task name: shots}; other tasks keep their YAML's (else 0)."""
    by_name: dict[str, set[str]] = {}
    for entry, leaves in suite.entries.items():
        for key in (entry, suite.names[entry]):
            by_name.setdefault(key, set()).update(leaves)
        for leaf in leaves:  # a task's name is that task only, not its entry's every task
            by_name.setdefault(leaf, set()).add(leaf)
    for group in suite.loaded["group_map"]:
        by_name.setdefault(group, set()).update(_leaves(suite, group))
    unknown = sorted(set(fewshot) - set(by_name))
    if unknown:
        raise StageError(f"evaluate.num_fewshot: {unknown[0]!r} is none of evaluate.tasks or their tasks")
    for name, task in suite.loaded["tasks"].items():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
    for key, shots in sorted(fewshot.items(), key=lambda kv: len(by_name[kv[0]]), reverse=True):  # specific wins
        for name in sorted(by_name[key]):
            suite.loaded["tasks"][name].set_config(key="num_fewshot", value=shots)
            suite.fewshot[name] = shots
    for name, task in suite.loaded["tasks"].items():
        _check_shots(name, task)


def _check_shots(name: str, task) -> None:
    """A task's shots fit its few-shot pool (lm-eval's sampler draws them with random.sample, which fails mid-scoring
    with "Sample larger than population"); drawn from the evaluation split itself, one row is the prompt's own."""
    shots = int(task.get_config("num_fewshot") or 0)
    if shots <= 0:
        return
    sampler = getattr(task, "sampler", None)
    rows = len(sampler.fewshot_docs()) if sampler is not None else 0
    fs = getattr(task, "fewshot_cfg", None)
    same = fs is not None and fs.split == task.config.test_split  # then lm-eval leaves the prompt's row out
    most = max(rows - 1, 0) if same else rows
    if shots > most:
        split = (fs.split if fs is not None else None) or _fallback_split(task)
        raise StageError(
            f"evaluate.num_fewshot: task {name} asks for {shots} few-shot examples, but its few-shot split ({split}) "
            f"has {rows} rows{' (one is the prompt itself)' if same else ''}; use at most {most} shots for it"
        )


def _fallback_split(task) -> str:
    """The split lm-eval draws few-shot examples from when the YAML names none (Task.fewshot_docs)."""
    c = task.config
    if task.has_training_docs():
        return c.training_split
    return c.validation_split if task.has_validation_docs() else c.test_split or "none"


def _leaves(suite: Suite, group: str) -> list[str]:
    out = []
    for kid in suite.loaded["group_map"].get(group, []):
        out += _leaves(suite, kid) if kid in suite.loaded["group_map"] else [kid]
    return out


def _check_greedy(suite: Suite) -> None:
    """Generation tasks decode greedily, with nothing greedy decoding would ignore (num_beams, repetition_penalty,
    max_length: tasks.harness.lm.greedy_problem); no model needed: checked by load, so the shard stage finds it."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from tasks.harness.lm import greedy_problem

    for name, task in suite.loaded["tasks"].items():
        if task.OUTPUT_TYPE == "generate_until":
            problem = greedy_problem(normalize_gen_kwargs(task.config.generation_kwargs or {}))
            if problem:
                raise StageError(f"evaluate.tasks: task {name} {problem}")


def check_generation(suite: Suite, max_length: int, who: str) -> None:
    """Generation tasks must leave room for the prompt in the model's context (greedy decoding: _check_greedy)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from tasks.harness.lm import default_max_gen_toks

    for name, task in suite.loaded["tasks"].items():
        if task.OUTPUT_TYPE != "generate_until":
            continue
        kw = normalize_gen_kwargs(task.config.generation_kwargs or {}, default_max_gen_toks(max_length))
        if kw["max_gen_toks"] >= max_length:
            raise StageError(
                f"evaluate.tasks: task {name} generates up to {kw['max_gen_toks']} tokens (max_gen_toks), not less "
                f"than {who}'s context of {max_length}; lower generation_kwargs.max_gen_toks in its YAML"
            )


def score(lm, suite: Suite) -> dict:
    """Run every task on `lm`: {"entries": {entry: {name, metric, value, n, shots}}, "tasks": {leaf: {…}}, "macro"}."""
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate

    random.seed(SEEDS[0])
    np.random.seed(SEEDS[1])
    torch.manual_seed(SEEDS[2])
    for task in suite.loaded["tasks"].values():  # the few-shot sampler's state: every model sees the same examples
        task.set_fewshot_seed(seed=SEEDS[3])
    res = evaluate(lm=lm, task_dict=suite.loaded, limit=suite.limit, bootstrap_iters=0, log_samples=False)
    leaves = {}
    for name, metric in suite.metric.items():
        r = res["results"][name]
        value = r[f"{metric},{suite.filters.get(name, 'none')}"]
        leaves[name] = {"metric": metric, "value": float(value), "n": int(r.get("sample_len", 0))}
        leaves[name]["shots"] = int(suite.loaded["tasks"][name].get_config("num_fewshot") or 0)
    entries = {}
    for entry, names in suite.entries.items():
        group = res.get("groups", {}).get(suite.groups.get(entry, ""), {})
        metric = leaves[names[0]]["metric"]
        value = group.get(f"{metric},{suite.filters.get(names[0], 'none')}")
        if not isinstance(value, (int, float)):  # no aggregate for this group (or a tag): mean of its tasks
            value = sum(leaves[n]["value"] for n in names) / len(names)
        entries[entry] = {
            "name": suite.names[entry],
            "metric": metric,
            "value": float(value),
            "n": sum(leaves[n]["n"] for n in names),
            "shots": max(leaves[n]["shots"] for n in names),  # few-shot examples per prompt (evaluate.num_fewshot)
        }
    macro = sum(e["value"] for e in entries.values()) / len(entries)
    return {"entries": entries, "tasks": leaves, "macro": macro}
