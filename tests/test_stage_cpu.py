"""CPU an Airflow task process spends in our own code: what it repeats is done once, with the same results."""

from __future__ import annotations


def test_yaml_file_parsed_once_per_text_and_never_shared(tmp_path):
    """A preset is parsed once per text (an `airflow dags test` loads its presets ~90 times); each reader gets its
    own copy, and an edited file — same size, maybe the same mtime tick — is parsed anew."""
    from data_prep.config import _parsed, yaml_mapping

    path = tmp_path / "p.yaml"
    path.write_text("train:\n  steps: 6\n")
    first = yaml_mapping(path)
    first["train"]["steps"] = 99  # a caller's edit never reaches the next reader
    hits = _parsed.cache_info().hits
    assert yaml_mapping(path) == {"train": {"steps": 6}}
    assert _parsed.cache_info().hits == hits + 1  # not parsed again
    path.write_text("train:\n  steps: 8\n")
    assert yaml_mapping(path) == {"train": {"steps": 8}}


def test_dag_params_validate_under_draft_7_with_the_same_verdicts():
    """Every Param of the pipeline and data DAGs names JSON Schema draft 7, whose metaschema check Airflow repeats on
    each of its ~5,200 validations in one `airflow dags test` (0.26 → 0.11 ms a Param here); each schema accepts and
    refuses the same values as under jsonschema's default draft (2020-12)."""
    from jsonschema.validators import Draft7Validator, Draft202012Validator, validator_for

    from tasks.pipeline import param_schemas

    samples = [None, 0, 1, -1, 2.5, 10**9, "", "x", "fp32", "demo-cpu", [], ["x"], [1], {}, True]
    for name, schema in param_schemas().items():
        assert validator_for(schema) is Draft7Validator, name
        Draft7Validator.check_schema(schema)
        plain = {k: v for k, v in schema.items() if k != "$schema"}
        for value in [*samples, schema.get("default"), *schema.get("enum", [])]:
            want = Draft202012Validator(plain).is_valid(value)
            assert Draft7Validator(schema).is_valid(value) == want, (name, value)


def test_a_stage_freezes_what_its_process_holds_at_its_start_and_at_exit(tmp_path):
    """run_stage collects and freezes what the process holds when a stage starts (tasks.procs.freeze_long_lived: out
    of later GC passes) and registers gc.freeze as an exit handler, once per process (skip_exit_collection;
    bench/bench_exit.py measures the exit): after stages — here two that fail at once, their --run-dir a file — the
    process's objects are frozen, and the exit handlers freeze what was made after."""
    import subprocess
    import sys

    from tests.helpers.dags import REPO

    code = (
        "import atexit, gc, sys\n"
        "from tasks.config import load_config\n"
        "from tasks.errors import StageError\n"
        "from tasks.runner import run_stage\n"
        "counts = []\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        run_stage('plan', load_config('ci-tiny'), sys.argv[1])\n"
        "    except StageError as e:\n"
        "        assert 'is a file' in str(e), e\n"
        "    counts.append(atexit._ncallbacks())\n"
        "at_start = gc.get_freeze_count()\n"
        "made_after = [[] for _ in range(50_000)]\n"
        "atexit._run_exitfuncs()\n"
        "print(counts[0] == counts[1], at_start, gc.get_freeze_count() - at_start)\n"
    )
    (tmp_path / "file").write_text("")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    argv = [sys.executable, "-c", code, str(tmp_path / "file")]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    once, at_start, at_exit = out.stdout.split()
    assert once == "True" and int(at_start) > 10_000 and int(at_exit) >= 50_000, out.stdout
