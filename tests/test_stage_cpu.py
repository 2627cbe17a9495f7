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
