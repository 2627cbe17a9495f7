"""lm-evaluation-harness as the evaluation engine: the project's model wrapper against lm-eval's own HFLM on a small
transformers-built model saved locally, task YAMLs in lm-eval's format from a temp dir, the demo task from the val
split, and every bad task input as one line before a model is loaded."""

from __future__ import annotations

import json
import random
import re
import sysconfig
from pathlib import Path

import pytest

from tasks.errors import StageError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A byte-level BPE trained on three stdlib files, saved by transformers beside a tiny random Qwen2 (biases on
    the q/k/v projections, grouped-query attention) whose embedding is that vocabulary."""
    from tests.helpers.models import stdlib_bpe, tiny_qwen2

    path = tmp_path_factory.mktemp("hf-tiny")
    tiny_qwen2(path, tokenizer=stdlib_bpe(384))
    return path


@pytest.fixture(scope="module")
def lms(ckpt):
    """(ours, lm-eval's HFLM) on the same local checkpoint, same context."""
    from tasks.harness import suite

    suite.offline()
    from lm_eval.models.huggingface import HFLM

    from tasks.harness.lm import ProjectLM
    from tasks.harness.models import full_precision, load_tokenizer

    import transformers

    # The checkpoint's tokenizer.json as it is (AutoTokenizer would take Qwen2's class from config.json and its
    # pre-tokenizer over this BPE in transformers 5): both sides score the same token ids.
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"), eos_token="<|endoftext|>")
    hf = HFLM(
        pretrained=str(ckpt),
        tokenizer=tok,
        backend="causal",
        device="cpu",
        dtype="float32",
        batch_size=4,
        max_length=128,
    )
    ours = ProjectLM(full_precision(ckpt, "fp32", "cpu"), load_tokenizer(ckpt), "cpu", batch_size=4)
    assert ours.max_length == 128  # from the checkpoint's config, as HFLM's
    return ours, hf


def _requests(kind: str, args: list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihoods_match_hflm(lms):
    """Shared contexts (several choices: our prefix-cache path), single requests, an empty context, contexts beyond
    the model's 128 tokens (left-truncated), rolling windows: the same numbers as lm-eval's HFLM within 1e-4."""
    ours, hf = lms
    text = (STDLIB / "textwrap.py").read_text()
    rng = random.Random(0)
    args = []
    for _ in range(8):
        a = rng.randrange(len(text) - 800)
        ctx = text[a : a + rng.randrange(20, 300)]
        for _ in range(rng.choice([1, 3])):
            b = rng.randrange(len(text) - 50)
            args.append((ctx, text[b : b + rng.randrange(2, 40)]))
    args += [("", "def wrap(text):"), (text[:3000], " return x"), ("x =", " 1")]
    want, got = hf.loglikelihood(_requests("loglikelihood", args)), ours.loglikelihood(_requests("loglikelihood", args))
    assert max(abs(w[0] - g[0]) for w, g in zip(want, got)) < 1e-4
    assert [w[1] for w in want] == [g[1] for g in got]  # greedy-match flags
    assert len({round(g[0], 3) for g in got}) > len(got) // 2  # really different requests, not one number
    rolling = [(text[i * 700 : (i + 1) * 700 + 300 * i],) for i in range(4)]  # up to 1600 chars: several windows
    want = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", rolling))
    got = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", rolling))
    assert max(abs(w - g) for w, g in zip(want, got)) < 1e-4 and len(set(got)) == 4


def test_generation_matches_hflm(lms):
    """Batched greedy generation (left-padded prompts of different lengths, KV cache) until a stop sequence or
    max_gen_toks: the same text as HFLM's transformers generate."""
    ours, hf = lms
    text = (STDLIB / "string.py").read_text()
    args = [(text[i * 300 : i * 300 + 40 + 37 * i], {"until": ["\n\n"], "max_gen_toks": 24}) for i in range(6)]
    args.append((text[:50], {"until": ["def"], "max_gen_toks": 8}))
    want, got = (
        hf.generate_until(_requests("generate_until", args)),
        ours.generate_until(_requests("generate_until", args)),
    )
    assert got == want and any(got)


def _yaml_task(folder: Path, name: str, rows: list[dict], extra: str = "") -> Path:
    """A task as lm-eval's documentation writes one (docs/task_guide.md: a local JSON dataset)."""
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = folder / f"{name}.yaml"
    yaml.write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {folder / f'{name}.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n" + extra
    )
    return yaml


QA = [
    {"question": "The return value of len([1, 2]) is", "choices": [" 2", " 3", " 'two'"], "answer": 0},
    {"question": "import os\nos.path.", "choices": ["join", "jump", "joint"], "answer": 0},
    {"question": "for i in range(3):\n   ", "choices": [" print(i)", " return", " class"], "answer": 0},
    {"question": "def f(x):\n    return", "choices": [" x", " def", " import"], "answer": 0},
]


def test_task_yaml_from_a_temp_dir_scores_as_with_hflm(lms, tmp_path):
    """A YAML in lm-eval's own format, from a temp dir, loaded by path and scored by our wrapper: the same accuracy
    as lm-eval's evaluator with HFLM on it; num_fewshot per task reaches the task."""
    from lm_eval.evaluator import evaluate

    from tasks.harness import suite

    ours, hf = lms
    path = _yaml_task(tmp_path, "py_quiz", QA * 5)
    s = suite.load([str(path)], None, None, {"py_quiz": 1}, ["acc"])
    assert s.names == {str(path): "py_quiz"} and s.loaded["tasks"]["py_quiz"].get_config("num_fewshot") == 1
    ours_r = suite.score(ours, s)
    for task in s.loaded["tasks"].values():  # what suite.score does before each model: the same few-shot draws
        task.set_fewshot_seed(seed=suite.SEEDS[3])
    theirs = evaluate(lm=hf, task_dict=s.loaded, bootstrap_iters=0, log_samples=False)["results"]["py_quiz"]
    assert ours_r["entries"][str(path)]["value"] == theirs["acc,none"] and ours_r["entries"][str(path)]["n"] == 20
    assert ours_r["macro"] == ours_r["entries"][str(path)]["value"]
    assert ours_r["entries"][str(path)]["shots"] == ours_r["tasks"]["py_quiz"]["shots"] == 1  # recorded with the score


def _by_name(lm, folder: Path, group: str, limit: int | None, shots: dict[str, int]) -> dict:
    """lm-eval's own results for `group` loaded by name, its folder on the include_path: what suite reports for a
    group by name (few-shot per task, the same seeds)."""
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    from tasks.harness import suite

    loaded = TaskManager(include_path=str(folder), include_defaults=False).load([group])
    for name, task in loaded["tasks"].items():
        task.set_config(key="num_fewshot", value=shots.get(name, 0))
        task.set_fewshot_seed(seed=suite.SEEDS[3])
    random.seed(suite.SEEDS[0])
    np.random.seed(suite.SEEDS[1])
    torch.manual_seed(suite.SEEDS[2])
    return evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)


def test_a_group_yaml_path_is_scored_as_the_group_by_name(lms, tmp_path):
    """A group YAML's path in evaluate.tasks (`group: my_group`, `task: [a, b]`) was refused as "lm-eval rejects this
    task (TypeError: unhashable type: 'list')": lm-eval loads a path as a task named by its `task:`. Now it is the
    group, loaded by name from its folder: each task's score and the group's aggregate as lm-eval's evaluator gives
    them for the group by name, evaluate.num_fewshot by group and by task name (the task's wins; a task's name set
    every task of its entry), evaluate.limit per task; a group without aggregate_metric_list scores the mean of its
    tasks."""
    from tasks.harness import suite

    ours, _ = lms
    rows = [dict(q, question=f"# {i}\n{q['question']}") for i, q in enumerate(QA * 3)]
    _yaml_task(tmp_path, "grp_a", rows)
    _yaml_task(tmp_path, "grp_b", QA[:3])
    weighted = tmp_path / "_my_group.yaml"
    weighted.write_text(
        "group: my_group\ntask: [grp_a, grp_b]\naggregate_metric_list:\n  - metric: acc\n    weight_by_size: true\n"
    )
    s = suite.load([str(weighted)], None, 5, {"my_group": 2, "grp_b": 1}, ["acc"])
    assert s.entries == {str(weighted): ["grp_a", "grp_b"]} and s.names == s.groups == {str(weighted): "my_group"}
    got = suite.score(ours, s)
    want = _by_name(ours, tmp_path, "my_group", 5, {"grp_a": 2, "grp_b": 1})
    assert {t: (r["value"], r["n"], r["shots"]) for t, r in got["tasks"].items()} == {
        "grp_a": (want["results"]["grp_a"]["acc,none"], 5, 2),
        "grp_b": (want["results"]["grp_b"]["acc,none"], 3, 1),
    }
    entry = got["entries"][str(weighted)]
    assert entry == {
        "name": "my_group",
        "metric": "acc",
        "value": want["groups"]["my_group"]["acc,none"],
        "n": 8,
        "shots": 2,
    }
    assert entry["value"] == pytest.approx(
        (5 * got["tasks"]["grp_a"]["value"] + 3 * got["tasks"]["grp_b"]["value"]) / 8
    )
    plain = tmp_path / "_plain.yaml"
    plain.write_text("group: plain_group\ntask:\n  - grp_a\n  - grp_b\n")
    s = suite.load([str(plain)], None, 5, {}, ["acc"])
    got = suite.score(ours, s)
    assert got["entries"][str(plain)]["name"] == "plain_group"
    assert got["entries"][str(plain)]["value"] == pytest.approx(sum(t["value"] for t in got["tasks"].values()) / 2)
    (tmp_path / "_twin.yaml").write_text("group: my_group\ntask: [grp_b]\n")  # indexed after _my_group.yaml
    with pytest.raises(StageError, match=r"_twin.yaml: lm-eval's index gives its group name 'my_group' to \S+/_my_gr"):
        suite.load([str(tmp_path / "_twin.yaml")], None, None, {}, ["acc"])
    (tmp_path / "old.yaml").write_text("group: old_style\ntask: grp_b\n")  # no list: a group of nothing
    with pytest.raises(StageError, match=r"old.yaml: lm-eval finds no task in it \(a group YAML lists its tasks"):
        suite.load([str(tmp_path / "old.yaml")], None, None, {}, ["acc"])


def test_mmlu_from_a_local_copy_as_docs_evaluation_says(lms, tmp_path):
    """docs/evaluation.md's recipe, in miniature: lm-eval's mmlu/default folder copied (four subjects, one per
    subgroup), its template's dataset_path pointed by the doc's sed at a local folder laid out like cais/mmlu
    (README `configs:`, a parquet file per subject and split), its group file's path in evaluate.tasks. It was refused
    (TypeError: unhashable type: 'list'); now the mmlu group, scored as lm-eval scores it by name, and its subgroup
    file _mmlu_stem.yaml the same way."""
    import shutil

    import lm_eval
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.harness import suite

    doc = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    cp = "cp -r .venv/lib/python3.11/site-packages/lm_eval/tasks/mmlu/default /data/tasks/mmlu"
    sed = "sed -i 's|^dataset_path: cais/mmlu|dataset_path: /data/mmlu|' /data/tasks/mmlu/_default_template_yaml"
    assert cp in doc and sed in doc and "'evaluate.tasks=[/data/tasks/mmlu/_mmlu.yaml]'" in doc
    folder, data = tmp_path / "tasks" / "mmlu", tmp_path / "mmlu"
    shutil.copytree(Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default", folder)
    subjects = ["abstract_algebra", "business_ethics", "econometrics", "formal_logic"]
    for path in folder.glob("mmlu_*.yaml"):
        if path.stem.removeprefix("mmlu_") not in subjects:
            path.unlink()
    template = folder / "_default_template_yaml"
    text = template.read_text()
    assert text.startswith("dataset_path: cais/mmlu\n")  # what the doc's sed replaces
    template.write_text(text.replace("dataset_path: cais/mmlu", f"dataset_path: {data}", 1))
    configs = ""
    for k, subject in enumerate(subjects):
        configs += f"- config_name: {subject}\n  data_files:\n"
        for split, n in (("test", 4), ("validation", 2), ("dev", 5)):
            configs += f"  - split: {split}\n    path: {subject}/{split}-*\n"
            (data / subject).mkdir(parents=True, exist_ok=True)
            rows = [QA[(i + k) % 4] for i in range(n)]
            table = {
                "question": [r["question"] for r in rows],
                "subject": [subject] * n,
                "choices": [[c.strip() for c in r["choices"]] + ["None"] for r in rows],
                "answer": [(i + k) % 4 for i in range(n)],
            }
            pq.write_table(pa.table(table), data / subject / f"{split}-00000-of-00001.parquet")
    (data / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    ours, _ = lms
    entry = str(folder / "_mmlu.yaml")
    s = suite.load([entry], None, None, {"mmlu": 2}, ["acc"])
    assert s.names == {entry: "mmlu"} and s.entries[entry] == [f"mmlu_{x}" for x in subjects]
    got = suite.score(ours, s)
    want = _by_name(ours, folder, "mmlu", None, {f"mmlu_{x}": 2 for x in subjects})
    assert got["entries"][entry]["value"] == want["groups"]["mmlu"]["acc,none"] and got["entries"][entry]["n"] == 16
    assert {t: r["value"] for t, r in got["tasks"].items()} == {t: want["results"][t]["acc,none"] for t in got["tasks"]}
    stem = str(folder / "_mmlu_stem.yaml")
    assert suite.load([stem], None, None, {}, ["acc"]).entries == {stem: ["mmlu_abstract_algebra"]}


def test_progress_lines_per_model_and_task_and_no_bars(lms, tmp_path, caplog, capfd):
    """Issue 28: a model's scoring prints progress lines per task (what runs, requests done/total, rate, ETA) at the
    start, every log_every requests and at the end, through logging (tasks.progress: Airflow's task log, `make
    run`); lm-eval's tqdm bar over the task's documents (Task.build_all_requests) writes nothing to stderr."""
    import logging
    import re

    from tasks.harness import suite
    from tasks.harness.lm import ProjectLM

    ours, _ = lms
    rows = [dict(q, question=f"# {i}\n{q['question']}") for i, q in enumerate(QA * 5)]  # 20 distinct contexts
    s = suite.load([str(_yaml_task(tmp_path, "py_quiz", rows))], None, None, {}, ["acc"])
    lm = ProjectLM(ours.model, ours.tok, "cpu", batch_size=4, label="evaluate INT8", log_every=24)
    caplog.set_level(logging.INFO, logger="tasks.progress")
    capfd.readouterr()
    suite.score(lm, s)
    err = capfd.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.progress"]
    # 20 questions of 3 choices: 60 requests, each question's choices one batch after its shared context
    done = [int(re.match(r"progress: evaluate INT8 py_quiz request (\d+)/60\b", x)[1]) for x in lines]
    assert done == [0, 24, 48, 60], lines
    assert lines[0] == "progress: evaluate INT8 py_quiz request 0/60 (0%)", lines
    rate = r"[\d.]+[kM]? requests/s"
    assert re.fullmatch(rf"progress: evaluate INT8 py_quiz request 24/60 \(40%\), {rate}, ETA \d+s", lines[1]), lines
    assert re.fullmatch(rf"progress: evaluate INT8 py_quiz request 60/60 \(100%\), {rate}, done", lines[3]), lines
    assert "20/20" not in err and "it/s" not in err, err  # no tqdm bar


def test_bad_task_inputs_are_one_line(tmp_path, ckpt, monkeypatch):
    from tasks.harness import suite

    def fails(match, entries, fewshot=None, metrics=("acc",), demo=None):
        with pytest.raises(StageError, match=match) as e:
            suite.load(entries, demo, None, fewshot or {}, list(metrics))
        assert "\n" not in str(e.value)

    good = _yaml_task(tmp_path, "good_quiz", QA)
    fails(r"evaluate.tasks: 'hellaswagg' is not an lm-eval task, group or tag \(close: hellaswag", ["hellaswagg"])
    # the project's own task is a close match too, and case and -/_ do not count: it was "(close: mmlu_continuation, …)"
    for typo, close in [("demo_continuation", "demo-continuation"), ("Demo-Continuation", "demo-continuation")]:
        fails(rf"evaluate.tasks: '{typo}' is not an lm-eval task, group or tag \(close: {close}[,)]", [typo])
    fails(r"'HellaSwag' is not an lm-eval task, group or tag \(close: hellaswag[,)]", ["HellaSwag"])
    with pytest.raises(StageError, match=r"'DEMO_continuation' is not an .* \(close: demo-continuation\)"):
        suite.check_names(["DEMO_continuation"], defaults=False)  # the env stage's early check
    fails(r"evaluate.tasks: .*nowhere.yaml: no such task YAML file", [str(tmp_path / "nowhere.yaml")])
    with monkeypatch.context() as m:  # a relative path is the repository's, not the cwd's: said, with the file
        m.chdir(tmp_path)
        fails(
            r"good_quiz.yaml: no such task YAML file \(\S+/good_quiz.yaml: a relative path is read from the "
            rf"repository; {tmp_path}/good_quiz.yaml exists: give its absolute path\)$",
            ["good_quiz.yaml"],
        )

    # Rows the task cannot score: lm-eval counts a target it cannot place as wrong (a warning; acc 0.000 and a gate
    # that passes) and fails on an unreadable row only after the models are loaded. Each is one line, at load.
    def variant(name, rows=QA, **yaml):
        path = _yaml_task(tmp_path, name, rows)
        text = path.read_text()
        for key, value in yaml.items():
            text = re.sub(rf"^{key}: .*$", f"{key}: {value}", text, flags=re.M)
        path.write_text(text)
        return [str(path)]

    row0 = r"task {}: row {} of its evaluation split: "
    fails(
        row0.format("typo_target", 0) + r"doc_to_target 'answr' is none of its columns \(answer, choices, question\)",
        variant("typo_target", doc_to_target="answr"),
    )
    fails(  # lm-eval renders the choices when it loads the task: named from the data file's first row
        r"typo_choice.yaml: doc_to_choice 'choice' is none of its columns \(answer, choices, question: \S+jsonl\)",
        variant("typo_choice", doc_to_choice="choice"),
    )
    far = [*QA[:2], {**QA[2], "answer": 7}, QA[3]]
    fails(
        row0.format("far_answer", 2) + r"its target 7 is neither an index below 3 nor one of its choices",
        variant("far_answer", far),
    )
    lost = [QA[0], {"question": QA[1]["question"], "choises": QA[1]["choices"], "answer": 0}, *QA[2:]]
    fails(
        row0.format("lost_choices", 1) + r"doc_to_choice gives None, not a list of choices",
        variant("lost_choices", lost),
    )
    empty = [QA[0], {**QA[1], "answer": None}, *QA[2:]]
    fails(row0.format("no_answer", 1) + r"its target is empty", variant("no_answer", empty))
    assert suite.load(variant("text_answer", [{**r, "answer": r["choices"][0]} for r in QA]), None, None, {}, ["acc"])
    bad = _yaml_task(tmp_path, "bad_key", QA, "no_such_option: 3\n")
    fails(
        r"bad_key.yaml: lm-eval rejects this task \(TypeError: .*unexpected keyword argument 'no_such_option'",
        [str(bad)],
    )
    missing = _yaml_task(tmp_path, "lost_data", QA)
    (tmp_path / "lost_data.jsonl").unlink()
    fails(
        rf"lost_data.yaml: dataset_kwargs.data_files {tmp_path}/lost_data.jsonl does not exist; write the path of ",
        [str(missing)],
    )
    # A new user's YAML as lm-eval's task guide writes one ("Using Local Datasets": `data_files: /path/to/my/json`):
    # a data file named relative to the YAML (datasets reads it from the cwd), a test split that one path does not have.
    (tmp_path / "guide.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    guide = tmp_path / "guide.yaml"
    guide.write_text(
        good.read_text()
        .replace("task: good_quiz", "task: guide")
        .replace("  data_files:\n    test: " + str(tmp_path / "good_quiz.jsonl"), "  data_files: guide.jsonl")
    )
    fails(
        rf"guide.yaml: dataset_kwargs.data_files 'guide.jsonl' is a relative path, which datasets reads from the "
        r"current directory \(.*\), not from the YAML's folder; write its absolute path "
        rf"\({tmp_path}/guide.jsonl exists",
        [str(guide)],
    )
    guide.write_text(guide.read_text().replace("data_files: guide.jsonl", f"data_files: {tmp_path / 'guide.jsonl'}"))
    fails(
        r"guide.yaml: test_split 'test' is not a split of its dataset, which has train \(datasets calls .*'train'\); "
        r"set test_split: train, or name the split in data_files \(\{test: PATH\}\)",
        [str(guide)],
    )
    guide.write_text(guide.read_text().replace("test_split: test", "test_split: train"))
    from tasks.config import load_config

    tasks = load_config("ci-tiny", sets=[f"evaluate.tasks=[{guide}]"]).evaluate.tasks  # as `--set` passes it
    assert suite.load(tasks, None, None, {}, ["acc"]).data_files == {"guide": [str(tmp_path / "guide.jsonl")]}
    # a standard task whose dataset is not in the HF datasets cache: offline, one line, no download attempted
    fails(r"evaluate.tasks: arc_easy: its dataset is not on disk \(.*Hub.*HF datasets cache", ["arc_easy"])
    fails(r"evaluate.num_fewshot: 'mmlu' is none of evaluate.tasks", [str(good)], fewshot={"mmlu": 5})
    fails(
        r"task good_quiz reports acc, none of evaluate.task_metrics \(exact_match\)",
        [str(good)],
        metrics=["exact_match"],
    )
    gen = tmp_path / "gen_quiz.yaml"
    gen.write_text(
        good.read_text().replace("task: good_quiz", "task: gen_quiz").replace("multiple_choice", "generate_until")
        + "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 200\n"
    )
    s = suite.load([str(gen)], None, None, {}, ["acc"])
    with pytest.raises(StageError, match=r"task gen_quiz generates up to 200 tokens \(max_gen_toks\), not less than"):
        suite.check_generation(s, 128, f"the model {ckpt}")
    suite.check_generation(s, 512, "a longer model")  # fits there
    # sampling is found by load itself (no model needed: the shard stage's check, before training)
    (tmp_path / "sampled.yaml").write_text(
        gen.read_text().replace("task: gen_quiz", "task: sampled_quiz") + "  do_sample: true\n  temperature: 0.7\n"
    )
    fails(r"task sampled_quiz samples \(do_sample/temperature\).*do_sample: false", [str(tmp_path / "sampled.yaml")])


def test_task_index_is_reused_until_a_yaml_in_its_folders_changes(tmp_path):
    """suite keeps lm-eval's TaskManager (its index: seconds of CPU with lm-eval's own tasks) while the task YAMLs of
    the folders it indexed are unchanged; an edited YAML is indexed again: a sibling's new name is found."""
    from tasks.harness import suite

    main = _yaml_task(tmp_path, "main_quiz", QA)
    sibling = _yaml_task(tmp_path, "quiz_a", QA)
    first = suite._task_manager([str(tmp_path)], defaults=False)
    assert suite._task_manager([str(tmp_path)], defaults=False) is first  # reused: nothing changed
    assert suite.load([str(main), "quiz_a"], None, None, {}, ["acc"]).entries["quiz_a"] == ["quiz_a"]
    sibling.write_text(sibling.read_text().replace("task: quiz_a", "task: quiz_b"))  # same size, maybe same mtime
    again = suite._task_manager([str(tmp_path)], defaults=False)
    assert again is not first and "quiz_b" in again.all_tasks and "quiz_a" not in again.all_tasks
    assert suite.load([str(main), "quiz_b"], None, None, {}, ["acc"]).entries["quiz_b"] == ["quiz_b"]


def _decoded_split(shard_dir: Path, split: str) -> str:
    from tokenizers import Tokenizer

    from data_prep.loader import ShardLoader
    from data_prep.manifest import load_manifest

    tok = Tokenizer.from_file(str(shard_dir / "tokenizer.json"))
    n = load_manifest(shard_dir)["splits"][split]["samples"]  # one batch of every window of the split
    rows = {}
    for x, y, keys in ShardLoader(shard_dir, split=split, batch_size=n, num_workers=0, shuffle=False, with_keys=True):
        rows.update({int(k): x[i].tolist() + y[i, -1:].tolist() for i, k in enumerate(keys)})
    assert len(rows) == n
    return tok.decode([t for k in sorted(rows) for t in rows[k]], skip_special_tokens=False)


def test_demo_task_comes_from_the_val_split_only(tmp_path):
    """Contexts and true continuations are val text (never train text: documents are split whole), the three
    others come from other val documents, every choice has the same length; the same shard set gives the same bytes;
    lm-eval loads the YAML; a shard set without a val split is one line."""
    from data_prep.testing import tiny_shard_set
    from tasks.harness import demo_task, suite
    from tasks.quant.gate import demo_keep

    shards = tiny_shard_set(tmp_path / "d", seq_len=64, vocab_size=512, n_docs=60, val_fraction=0.3, shard_multiple=1)
    yaml = demo_task.write(shards, tmp_path / "t", 40, 0, demo_keep, "evaluation part")
    rows = [json.loads(line) for line in (tmp_path / "t" / f"{demo_task.NAME}.jsonl").read_text().splitlines()]
    val, train = _decoded_split(shards, "val"), _decoded_split(shards, "train")
    assert len(rows) == 40 and {len(r["choices"]) for r in rows} == {4}
    for r in rows:
        true = r["choices"][r["label"]]
        assert r["context"] + true in val
        assert {len(c) for c in r["choices"]} == {demo_task.SPAN_CHARS} and len(set(r["choices"])) == 4
        assert all(r["context"] + c not in val for i, c in enumerate(r["choices"]) if i != r["label"])
    assert sum(r["context"] in train for r in rows) <= 2  # (stdlib files share a few boilerplate lines)
    assert 0 < sum(r["label"] == 0 for r in rows) < 40  # the answer's position is drawn, not fixed
    first = (tmp_path / "t" / f"{demo_task.NAME}.jsonl").read_bytes()
    demo_task.write(shards, tmp_path / "again", 40, 0, demo_keep, "evaluation part")
    assert (tmp_path / "again" / f"{demo_task.NAME}.jsonl").read_bytes() == first  # fixed seed: reproducible
    s = suite.load(["demo-continuation"], yaml, 10, {}, ["acc", "acc_mutual_info"])
    assert s.metric == {demo_task.NAME: "acc_mutual_info"} and s.limit == 10
    no_val = tiny_shard_set(tmp_path / "nv", seq_len=64, n_docs=8, val_fraction=0.0, shard_multiple=1)
    with pytest.raises(StageError, match=r"^demo-continuation: the val split of .* gives 0 examples .* reshard"):
        demo_task.write(no_val, tmp_path / "nv-task", 40, 0, demo_keep, "evaluation part")
    # a val split of one long document gives none either, and says why ("0 examples (… passages)" hid it)
    from data_prep.build import build_shard_set
    from data_prep.clean import VAL, doc_hash, normalize, split_of
    from tests.helpers.shards import shard_cfg

    split = lambda f: split_of(doc_hash(normalize(f.read_text())), 0.5)  # noqa: E731 (the build's own rule)
    files = sorted(f for f in (STDLIB / "json").glob("*.py") if len(f.read_text()) > 2000)
    one = [next(f for f in files if split(f) == VAL)] + [f for f in files if split(f) != VAL]
    cfg = shard_cfg(tmp_path / "ov", one, seq_len=64, val_fraction=0.5, shard_multiple=1, shard_size_mb=1)
    one_val = build_shard_set(cfg)  # one shard per split: no window left out (a gap reads as two documents)
    val_split = one_val.manifest["splits"]["val"]
    assert val_split["samples"] > 10 and val_split["dropped_samples"] == 0
    with pytest.raises(StageError, match=r"passages, all of one document: the wrong choices come from other documen"):
        demo_task.write(one_val.shard_dir, tmp_path / "ov-task", 40, 0, demo_keep, "evaluation part")


def test_evaluate_says_why_quantize_scores_are_not_reused(tmp_path, capsys):
    """quantize's gate.json without task scores (its gate was ppl/accuracy) is not "other tasks or models"."""
    import json

    from tasks.quant.gate import reusable_scores

    rec = tmp_path / "gate.json"
    rec.write_text(json.dumps({"key": "k", "metric": "ppl_drop_pct"}))
    assert reusable_scores(rec, "k") is None
    assert "scored no tasks (not a task gate); scoring the tasks now" in capsys.readouterr().err
    rec.write_text(json.dumps({"key": "other", "ref_scores": {"a": 1}, "int8_scores": {"a": 1}}))
    assert reusable_scores(rec, "k") is None
    assert "measured other tasks or models; scoring the tasks now" in capsys.readouterr().err
    rec.write_text(json.dumps({"key": "k", "ref_scores": {"a": 1}, "int8_scores": {"a": 2}}))
    assert reusable_scores(rec, "k") == {"ref": {"a": 1}, "int8": {"a": 2}}
