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
