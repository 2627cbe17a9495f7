"""Config: presets, layered overrides, and one clear line per problem."""

import re

import pytest

from tasks.config import load_config, parse_sets
from tasks.errors import ConfigError


def test_demo_preset_is_the_default_and_valid():
    cfg = load_config()
    assert cfg.preset == "demo-cpu"
    assert cfg.hardware.device == "cpu" and cfg.data.inputs == ["stdlib"]


def test_layers_later_wins(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("train:\n  steps: 7\n  lr: 0.01\ndata:\n  seq_len: 64\n")
    cfg = load_config(
        str(f),
        overrides={"train": {"steps": 9}, "data.vocab_size": 1024},
        sets=["train.lr=0.02", "parallel.recompute=full", "data.inputs=a.txt,b.jsonl"],
    )
    assert (cfg.train.steps, cfg.train.lr, cfg.data.seq_len, cfg.data.vocab_size) == (9, 0.02, 64, 1024)
    assert cfg.parallel.recompute == "full" and cfg.data.inputs == ["a.txt", "b.jsonl"]
    # What the caller set (overrides, --set) is explicit; the file's values are defaults for this run.
    assert cfg.explicit == {"train.steps", "data.vocab_size", "train.lr", "parallel.recompute", "data.inputs"}
    assert "data.seq_len" not in cfg.explicit and "explicit" not in cfg.to_dict()
    import copy

    assert copy.deepcopy(cfg).explicit == cfg.explicit


def test_list_items_take_the_item_type():
    cfg = load_config(sets=["plan.zero_stages=0,1", "plan.recompute=none,full", "hardware.probe_sizes_mb=[1, 2.5]"])
    assert cfg.plan.zero_stages == [0, 1] and all(type(z) is int for z in cfg.plan.zero_stages)
    assert cfg.plan.recompute == ["none", "full"] and cfg.hardware.probe_sizes_mb == [1.0, 2.5]
    with pytest.raises(ConfigError, match=r"plan.zero_stages\[1\]: expected an integer, got 'x'"):
        load_config(sets=["plan.zero_stages=0,x"])
    with pytest.raises(ConfigError, match=r"plan.zero_stages: \[0, 4\] must be a non-empty list of 0, 1, 2, 3"):
        load_config(sets=["plan.zero_stages=0,4"])


def test_digest_tracks_content():
    a, b = load_config(), load_config(sets=["train.steps=41"])
    assert a.digest() == load_config().digest() and a.digest() != b.digest()


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["train.steps=0"], "train.steps: 0 must be in [1, 1000000000]"),
        (["parallel.recompute=sometimes"], "parallel.recompute: 'sometimes' is not one of none, selective, full"),
        (["hardware.launcher=kubernets"], "'kubernets' is not one of local, kubernetes; did you mean kubernetes?"),
        (["train.precision=BF16"], "'BF16' is not one of fp32, bf16, fp16; did you mean bf16?"),
        (["data.seq_len=abc"], "data.seq_len: expected an integer, got 'abc'"),
        (["train.steps=yes"], "train.steps: expected an integer, got 'yes'"),  # as typed (it read 'true')
        (["train.lr=off"], "train.lr: expected a finite number, got 'off'"),
        (["data.nope=1"], "data.nope: unknown key"),
        (["nosection.x=1"], "nosection.x: unknown section"),
        (["train.micro_batch=16", "train.global_batch=8"], "train.micro_batch: 16 exceeds train.global_batch 8"),
        (["hardware.hccl_connect_timeout=30"], "hardware.hccl_connect_timeout: 30 must be in [120, 7200]"),
        (["plan.schedules=1f1b,zigzag"], "plan.schedules: ['1f1b', 'zigzag'] must be a non-empty list of gpipe"),
    ],
)
def test_each_problem_is_one_clear_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_config(sets=sets)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_a_later_set_of_the_same_key_wins():
    """`--set` repeated for one key: the last wins (scripts append overrides to a base list), as a later layer
    (Params, then --set) wins over an earlier one."""
    assert load_config(sets=["train.steps=3", "train.steps=4"]).train.steps == 4


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(sets=["train.steps=0", "data.val_fraction=0.9"])
    assert len(e.value.problems) == 2


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'nope' \(known: .*demo-cpu"):
        load_config("nope")
    with pytest.raises(ConfigError, match=r"--config configs: a directory; give a preset file .*demo-cpu"):
        load_config("configs")


def test_bad_yaml_is_one_line_with_location(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert "bad.yaml" in str(e.value) and "not valid YAML" in str(e.value) and "\n" not in str(e.value)


def test_yaml_that_is_not_a_mapping(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(str(f))


def test_set_syntax_error():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_sets(["train.steps"])


def test_every_layer_goes_through_the_same_model(tmp_path):
    """A YAML preset, DAG Params / --conf (overrides), --set and code (apply_overrides, validate) give one line."""
    from tasks.config import apply_overrides, validate

    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  steps: 0\n")
    lines = []
    for kwargs in (
        {"preset_or_path": str(f)},
        {"overrides": {"train": {"steps": 0}}},
        {"overrides": {"train.steps": 0}},
        {"sets": ["train.steps=0"]},
    ):
        with pytest.raises(ConfigError) as e:
            load_config(**kwargs)
        lines.append(e.value.problems)
    cfg = load_config()
    train = cfg.train
    with pytest.raises(ConfigError) as e:
        apply_overrides(cfg, {"train.steps": "0"})
    lines.append(e.value.problems)
    assert cfg.train.steps == 300 and "train.steps" not in cfg.explicit  # refused: nothing set
    apply_overrides(cfg, {"train.steps": "7", "plan.zero_stages": "1,2"})
    assert cfg.train is train and train.steps == 7 and cfg.plan.zero_stages == [1, 2]  # in place, typed
    assert {"train.steps", "plan.zero_stages"} <= cfg.explicit
    cfg.train.steps = 0  # code changed a field: validate() checks it with the same model
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    lines.append(e.value.problems)
    assert lines == [["train.steps: 0 must be in [1, 1000000000]"]] * len(lines)


@pytest.mark.parametrize(
    "sets, line",
    [
        (["data.seq_le=64"], "data.seq_le: unknown key; did you mean data.seq_len? (known in data: inputs,"),
        (["trian.steps=3"], "trian.steps: unknown section 'trian'; did you mean train? (known: hardware,"),
        (["parallel.zero=x"], "parallel.zero: expected an integer, got 'x'"),
        (["parallel.zero=4"], "parallel.zero: 4 is not one of 0, 1, 2, 3"),
        (["hardware.bind_cpus=maybe"], "hardware.bind_cpus: expected true/false, got 'maybe'"),
        (["train.lr=.nan"], "train.lr: expected a finite number, got nan"),
        (["data.min_chars=100", "data.max_chars=10"], "data.min_chars: 100 exceeds max_chars 10"),
        (["data.inputs=[]"], "data.inputs: must not be empty"),
    ],
)
def test_pydantic_errors_read_as_the_projects_lines(sets, line):
    with pytest.raises(ConfigError) as e:
        load_config(sets=sets)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(line), e.value.problems


def test_one_data_model_for_the_pipeline_and_data_prep():
    """DataConfig is data_prep's model (tasks imports it): the same fields, defaults and ranges both ways; the
    pipeline names the bound, data_prep's own CLI says `is out of range` (its format)."""
    from data_prep.config import DataConfig, ShardConfig
    from data_prep.errors import DataPrepError
    from tasks.config import PipelineConfig

    assert PipelineConfig.model_fields["data"].annotation is DataConfig is ShardConfig
    assert (DataConfig().seq_len, DataConfig().val_fraction, DataConfig().shard_multiple) == (256, 0.05, 0)
    for key, value, bound in (
        ("seq_len", 4, "in [8, 1048576]"),
        ("val_fraction", 0.6, "in [0.0, 0.5]"),
        ("shard_multiple", -1, "in [0, 65536]"),
    ):
        with pytest.raises(ConfigError, match=rf"data.{key}: {value} must be {re.escape(bound)}"):
            load_config(overrides={f"data.{key}": value})
        with pytest.raises(DataPrepError, match=f"^{key}: {value} is out of range$"):
            ShardConfig.from_dict({key: value})
    assert ShardConfig.from_dict({"seq_len": "8", "inputs": "a.txt"}).inputs == ["a.txt"]  # text read as the type
    # The shard-set cache key is what it was: the loader's and the pipeline's fields stay out of it.
    assert sorted(DataConfig().key_fields()) == sorted(
        [
            "text_field",
            "max_documents",
            "min_chars",
            "max_chars",
            "on_decode_error",
            "vocab_size",
            "eos_token",
            "token_dtype",
            "seq_len",
            "val_fraction",
            "shard_size_mb",
            "shard_multiple",
        ]
    )


def test_form_and_model_refuse_the_same_values():
    """For every Param: each bound, one past it and every enum value (and one more) are accepted by the trigger
    form's JSON schema exactly when the config model's field accepts them."""
    import jsonschema
    from pydantic import ValidationError

    from tasks.config import PipelineConfig
    from tasks.pipeline import PARAMS, param_schemas

    forms = param_schemas()
    checked = 0
    for name, key, *_ in PARAMS:
        if key is None:
            continue
        form, (section, _, field) = forms[name], key.partition(".")
        step = 1 if "integer" in form["type"] else 0.5
        values = [v for b in ("minimum", "maximum") if b in form for v in (form[b], form[b] + step, form[b] - step)]
        values += [*form.get("enum", []), "bogus"] if "enum" in form else []
        for value in values:
            try:
                jsonschema.validate(value, form)
                by_form = True
            except jsonschema.ValidationError:
                by_form = False
            try:
                PipelineConfig.model_fields[section].annotation.model_validate({field: value})
                by_model = True
            except ValidationError:
                by_model = False
            assert by_form == (by_model or value is None), (name, value, by_form, by_model)
            checked += 1
    assert checked > 40


def test_the_preset_is_chosen_not_set(tmp_path):
    """--set preset=ci-tiny (or a DAG Param of that name) once loaded demo-cpu and said nothing; a preset file's own
    `preset:` key was dropped the same way."""
    with pytest.raises(ConfigError) as e:
        load_config(sets=["preset=ci-tiny"])
    assert "--config ci-tiny" in str(e.value) and "\n" not in str(e.value)
    f = tmp_path / "mine.yaml"
    f.write_text("preset: ci-tiny\ntrain:\n  steps: 7\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: a top-level 'preset' key is ignored .*; remove it$"):
        load_config(str(f))
