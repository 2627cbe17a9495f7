"""Config: presets, layered overrides, and one clear line per problem."""
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
    cfg = load_config(str(f), overrides={"train": {"steps": 9}, "data.vocab_size": 1024},
                      sets=["train.lr=0.02", "parallel.recompute=full", "data.inputs=a.txt,b.jsonl"])
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


@pytest.mark.parametrize("sets, needle", [
    (["train.steps=0"], "train.steps: 0 must be >= 1"),
    (["parallel.recompute=sometimes"], "parallel.recompute: 'sometimes' is not one of none, selective, full"),
    (["data.seq_len=abc"], "data.seq_len: expected an integer, got 'abc'"),
    (["data.nope=1"], "data.nope: unknown key"),
    (["nosection.x=1"], "nosection.x: unknown section"),
    (["train.micro_batch=16", "train.global_batch=8"], "train.micro_batch: 16 exceeds train.global_batch 8"),
    (["hardware.hccl_connect_timeout=30"], "hardware.hccl_connect_timeout: 30 must be in [120, 7200]"),
    (["plan.schedules=1f1b,zigzag"], "plan.schedules: ['1f1b', 'zigzag'] must be a non-empty list of gpipe"),
])
def test_each_problem_is_one_clear_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_config(sets=sets)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(sets=["train.steps=0", "data.val_fraction=0.9"])
    assert len(e.value.problems) == 2


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'nope' \(known: .*demo-cpu"):
        load_config("nope")


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
