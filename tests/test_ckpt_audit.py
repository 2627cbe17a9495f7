"""Checkpoint and resume audit (tasks/parallel/checkpoint.py): a setting that trains nothing differently does not make
a finished run "trained with other settings"; a resume under another train.optimizer (the load failed on every rank,
at every retry) or model.hf_path (silently ignored) is refused before launch in one line; a damaged checkpoint past
train.steps still says the run went past it; a resumed run trains with this config's weight decay, not the
saved one; a step-N directory whose meta.json was lost is named, not passed over. In-process, one rank at most."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tasks.errors import ConfigError
from tests.helpers.train_fixture import configure, context, fake_run, shards  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def _checkpoint(cfg, run: Path, shards: Path, step: int) -> Path:  # noqa: F811
    """A run directory whose newest checkpoint step-`step` was saved by `cfg` on `shards` (meta.json only)."""
    return fake_run(cfg, run, shards, step, with_metrics=False)


def test_rehearsal_steps_does_not_shape_training(tmp_path):
    from tasks.config import PipelineConfig
    from tasks.parallel.checkpoint import config_changes, shaping_config

    now = PipelineConfig().to_dict()
    assert "train.rehearsal_steps" not in shaping_config(now)
    # a checkpoint of an earlier version recorded it: judged by today's rule, it is no change
    saved = {**shaping_config(now), "train.rehearsal_steps": 3}
    now["train"]["rehearsal_steps"] = 0
    (tmp_path / "meta.json").write_text(json.dumps({"shaping": saved}))
    assert config_changes(tmp_path, now) == []
    now["train"]["lr"] = 1.0  # a shaping one still is
    assert config_changes(tmp_path, now) == [f"train.lr: {saved['train.lr']!r} → 1.0"]


def test_a_field_added_since_a_checkpoint_counts_as_its_default(tmp_path):
    """A checkpoint saved before a shaping field existed (its meta.json lacks the key) trained as the field's default:
    a resume or rerun at the default is no change (it was "None → value" for every old run, and a finished run was
    refused), one at another value is named with the default as the old value."""
    from tasks.config import PipelineConfig
    from tasks.parallel.checkpoint import config_changes, shaping_config

    now = PipelineConfig().to_dict()
    full = shaping_config(now)
    assert {"train.lr", "model.converters", "data.seq_len"} <= full.keys()
    for key in full:
        (tmp_path / "meta.json").write_text(json.dumps({"shaping": {k: v for k, v in full.items() if k != key}}))
        assert config_changes(tmp_path, now) == [], key
    (tmp_path / "meta.json").write_text(json.dumps({"shaping": {k: v for k, v in full.items() if k != "train.lr"}}))
    now["train"]["lr"] = 1.0
    assert config_changes(tmp_path, now) == [f"train.lr: {full['train.lr']!r} → 1.0"]


def test_the_shaping_lists_name_real_fields_and_docs_stages_names_them_all():
    """_NOT_SHAPING, _DATA_SHAPING and _QAT_SHAPING name fields the config has (a misspelt name would leave the field
    counted as shaping, or not, silently), and docs/stages.md's Resume paragraph names each (by the word it groups
    them under for checkpointing and validation)."""
    from tasks.config import PipelineConfig
    from tasks.parallel import checkpoint as ck

    fields = {sec: PipelineConfig.model_fields[sec].annotation.model_fields for sec in ("train", "data", "quantize")}
    lists = {"train": ck._NOT_SHAPING["train"], "data": ck._DATA_SHAPING, "quantize": ck._QAT_SHAPING}
    assert set(ck._NOT_SHAPING) == {"train"}, "docs/stages.md lists train's exceptions only"
    for sec, names in lists.items():
        assert set(names) <= fields[sec].keys(), (sec, set(names) - fields[sec].keys())
    stages_md = (REPO / "docs" / "stages.md").read_text()
    resume = stages_md[stages_md.index("- Resume: rerunning") :].split("\n- ")[0]
    grouped = {"checkpoint_every": "checkpointing", "keep_checkpoints": "checkpointing", "eval_every": "validation",
               "eval_samples": "validation", "early_stop_patience": "validation"}  # fmt: skip
    for names in lists.values():
        for name in names:
            assert re.search(rf"\b{grouped.get(name, name)}\b", resume), f"docs/stages.md's Resume lacks {name}"


def test_resume_under_another_optimizer_is_refused_before_launch(cfg, tmp_path, shards):  # noqa: F811
    from tasks.stages import train

    run = tmp_path / "run"
    ckpt = _checkpoint(configure(cfg, **{"train.optimizer": "sgd"}), run, shards, step=2)  # train.steps 5: unfinished
    with pytest.raises(ConfigError) as e:
        train.prepare(configure(cfg, **{"train.optimizer": "adamw"}), context(run, shards))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {ckpt} was trained with train.optimizer sgd")
    assert "set train.optimizer=sgd to resume it, or use --fresh to start over" in msg
    # the same optimizer resumes
    spec = train.prepare(configure(cfg, **{"train.optimizer": "sgd"}), context(run, shards))
    assert spec["resume_from"] == str(ckpt)


def test_a_resume_does_not_ignore_a_new_model_hf_path(tmp_path):
    from data_prep.config import REPO_ROOT
    from tasks.config import PipelineConfig
    from tasks.parallel.checkpoint import resume_problem, shaping_config

    config = PipelineConfig().to_dict()
    (tmp_path / "meta.json").write_text(json.dumps({"shaping": shaping_config(config)}))  # random init
    config["model"]["hf_path"] = "var/models/other"
    msg = resume_problem(tmp_path, config)
    assert msg.startswith(f"checkpoint {tmp_path} was trained from model.hf_path (none: random init), this config ")
    assert "never var/models/other's; use --fresh (or a new --run-dir) to start from var/models/other" in msg
    # trained from it: the same directory (relative or absolute) resumes; dropping hf_path resumes too
    (tmp_path / "meta.json").write_text(json.dumps({"shaping": shaping_config(config)}))
    config["model"]["hf_path"] = str(REPO_ROOT / "models" / "x")
    assert resume_problem(tmp_path, config) is not None
    (tmp_path / "meta.json").write_text(json.dumps({"shaping": {"model.hf_path": "models/x"}}))
    assert resume_problem(tmp_path, config) is None
    config["model"]["hf_path"] = ""
    assert resume_problem(tmp_path, config) is None


def test_a_damaged_checkpoint_past_train_steps_is_not_handed_back_as_the_shorter_run(cfg, tmp_path, shards):  # noqa: F811
    from tasks.errors import StageError
    from tasks.stages import train

    c = configure(cfg)  # train.steps 5
    run = tmp_path / "run"
    _checkpoint(c, run, shards, step=5)
    rows = [{"step": s, "loss": 6.0, "tokens_per_s": 1.0} for s in range(1, 8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    longer = _checkpoint(c, tmp_path / "longer", shards, step=7)  # an earlier, longer run's step-7, since damaged
    meta = json.loads((longer / "meta.json").read_text())
    (longer / "meta.json").write_text(json.dumps({**meta, "files": {"__0_0.distcp": {"bytes": 1, "sha256": "0"}}}))
    longer.rename(run / "checkpoints" / "step-7")
    # the resume skips step-7 (it does not verify) and finds step-5 = train.steps; the run went past it all the same
    with pytest.raises(StageError, match=r"^train.steps: 5, but .* already holds checkpoint step-7, trained past it"):
        train.run(c, context(run, shards))


def test_a_step_dir_without_meta_json_is_named(tmp_path):
    from tasks.parallel.checkpoint import latest_verified

    for step in (2, 4, 6):
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / "step-2" / "meta.json").write_text("{}")  # no `files`: an old checkpoint, trusted
    (tmp_path / "step-4.tmp").mkdir()  # a save cut short: not a checkpoint, not a damage
    found, skipped = latest_verified(tmp_path)
    assert found == (2, tmp_path / "step-2")
    assert skipped == ["step-6: meta.json is missing", "step-4: meta.json is missing"]


@pytest.fixture
def one_rank(tmp_path):
    from tasks.device import dist_backend

    dist.init_process_group(dist_backend("cpu"), store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Loader:
    def __init__(self, shard_dir):
        self.shard_dir, self.position = shard_dir, 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _optimizer(weight_decay: float):
    """A small model and its (AdamW, LambdaLR) as the trainer builds them (tasks.parallel.optim.build_optimizers)."""
    from tasks.config import TrainConfig
    from tasks.parallel.optim import build_optimizers

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    [(opt, sched)] = build_optimizers([model], TrainConfig(weight_decay=weight_decay, warmup_steps=1, steps=10))
    return model, opt, sched


def test_resume_trains_with_this_runs_weight_decay(one_rank, tmp_path, shards, monkeypatch):  # noqa: F811
    import tasks.parallel.checkpoint as ckpt

    monkeypatch.setattr(ckpt, "load_loader_state", lambda path: {"position": 7})  # the loader's own format: elsewhere
    mgr = ckpt.CheckpointManager(tmp_path / "ckpt", keep=2, rank=0, coords={"dp": 0, "tp": 0, "pp": 0}, dp=1, world=1)
    model, opt, sched = _optimizer(0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched.step()
    path = mgr.save(1, [model], [(opt, sched)], _Loader(shards), {})

    model2, opt2, sched2 = _optimizer(0.0)  # the resumed run's config: train.weight_decay 0
    loader = _Loader(shards)
    step, _ = mgr.load(path, [model2], [(opt2, sched2)], loader)
    assert step == 1 and loader.position == 7
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.0]  # this run's, not the checkpoint's 0.1
    saved, loaded = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert torch.equal(saved[0]["exp_avg"], loaded[0]["exp_avg"])  # the optimizer state itself is the saved one
