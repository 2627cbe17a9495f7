"""The validation loss during training (tasks/train/validation.py): dp2, tp2 and pp2 log the val.loss one plain process
computes on the same weights and val slice (train_fixture.reference_run: the dp1 value) at the same steps, without
changing the training curve; early stopping ends the run cleanly after `patience` evaluations without a new best and
exports the best checkpoint, not the last; the best step reaches train.json; a val split too small for one global batch
is one line at launch (and a refusal when early stopping needs it)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.train_fixture import (
    assert_same_run,
    checkpoint_params,
    configure,
    context,
    metrics,
    reference_run,
    shards,  # noqa: F401
    torchrun,
    write_spec,
)

# Evaluations at steps 3 and 4 (the last) on 12 → 16 sequences: two global batches of the val split.
VAL = {"train.steps": 4, "train.eval_every": 3, "train.eval_samples": 12}
LAYOUTS = {
    "dp2": {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1},
    "tp2": {"parallel.dp": 1, "parallel.tp": 2, "parallel.pp": 1},
    "pp2": {"parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
}
# AdamW at lr 1 without warm-up: every step moves each weight by about 1, so the val loss is best after step 1 and
# rises at steps 2 and 3 whatever the corpus (the reference: 25.3, 40.1, 59.7 on CPython 3.11.7's standard library,
# 24.5, 41.3, 46.1 on 3.11.2's; lr 0.1 rose on the first and fell at step 3 on the second), so patience 2 stops the
# run at step 3 with step 1 the best.
EARLY = {
    "parallel.dp": 2,
    "train.steps": 6,
    "train.eval_every": 1,
    "train.early_stop_patience": 2,
    "train.lr": 1.0,
    "train.min_lr": 1.0,
    "train.warmup_steps": 0,
    "train.keep_checkpoints": 1,
    "train.divergence_factor": 0,
}


@pytest.mark.slow
def test_val_loss_same_in_every_layout_and_early_stop(cfg, tmp_path, shards):
    from tasks.config import load_config
    from tasks.model.hf_io import load_hf
    from tasks.stages import train

    two = {"hardware.nproc_per_node": 2}
    specs = [
        write_spec(configure(cfg, **two, **VAL, **sets), tmp_path / name, shards) for name, sets in LAYOUTS.items()
    ]
    early_cfg = configure(cfg, **two, **EARLY)
    early = write_spec(early_cfg, tmp_path / "early", shards, export={"tokenizer_dir": str(shards)})
    rc, out = torchrun(configure(cfg, **two), 2, [*specs, early], tmp_path / "torchrun.log")
    assert rc == 0, out[-3000:]

    ref = reference_run(configure(load_config("demo-cpu"), **VAL), shards, 4)
    assert sorted(ref["val.loss"]) == [3, 4]
    # Loss and gradient norm per step as the reference's; val.loss at steps 3 and 4 within 1e-6 (measured: 8e-8; the
    # dp2 value of rank 0's half of the slice alone is 1.3e-4 off).
    for name in LAYOUTS:
        assert_same_run(tmp_path / name, ref, name, steps=range(1, 5), val_rel=1e-6)

    run = tmp_path / "early"
    got = metrics(run)
    assert sorted(got) == [1, 2, 3] and all("val.loss" in r for r in got.values()), got
    assert got[1]["val.loss"] < got[2]["val.loss"] < got[3]["val.loss"], got
    assert all(r["val.time_s"] > 0 for r in got.values()), got  # the evaluation's own cost, logged with it
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert summary["early_stop"]["step"] == 3 and "train.early_stop_patience 2" in summary["early_stop"]["reason"]
    best = run / "checkpoints" / "step-1"
    assert summary["validation"]["best_step"] == 1 and summary["export_from"] == str(best), summary
    # keep_checkpoints 1 kept the best beside the newest; the stop step's checkpoint records the early stop.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-3"]
    assert json.loads((run / "checkpoints" / "step-3" / "meta.json").read_text())["early_stop"]["step"] == 3
    # The HF export holds step 1's weights, not step 3's.
    exported = load_hf(run / "hf").state_dict()
    first, last = checkpoint_params(best), checkpoint_params(run / "checkpoints" / "step-3")
    assert all(exported[k].equal(first[k]) for k in first), "the export is not the best checkpoint"
    assert not all(exported[k].equal(last[k]) for k in last)

    # train.json: the best step and its checkpoint, the early stop in the summary line; a rerun is the same run.
    ctx = context(run, shards, no_export=False)
    result = train.run(early_cfg, ctx)
    assert result["reused"] and result["steps"] == 3, result
    best_of = (result["val.best_step"], result["val.best_checkpoint"], result["exported_from"])
    assert best_of == (1, str(best), str(best)), result
    assert result["val.best_loss"] == got[1]["val.loss"] and result["val.loss"] == got[3]["val.loss"]
    assert "early stop at step 3" in result["summary"], result
    assert f"best {got[1]['val.loss']:.2f} at step 1" in result["summary"], result


def test_val_split_too_small_is_one_line_at_launch(cfg, tmp_path, capsys):
    from data_prep.testing import tiny_shard_set
    from tasks.errors import ConfigError

    no_val = tiny_shard_set(tmp_path / "shards", val_fraction=0.0)
    spec = json.loads(write_spec(configure(cfg), tmp_path / "run", no_val).read_text())
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "validation loss off" in ln]
    assert len(lines) == 1 and "holds 0 sequences" in lines[0] and "data.val_fraction" in lines[0], lines
    assert spec["validation"] is None and lines[0].removeprefix("warning: ") in spec["warnings"]
    with pytest.raises(ConfigError, match=r"train.early_stop_patience 2 needs the validation loss off: the val split"):
        write_spec(configure(cfg, **{"train.early_stop_patience": 2}), tmp_path / "run2", no_val)


def test_plan_rounds_to_global_batches_and_warns_when_short():
    from types import SimpleNamespace

    from tasks.config import PipelineConfig
    from tasks.train.validation import plan

    t = PipelineConfig().train
    t.steps, t.eval_samples = 300, 20
    lay = SimpleNamespace(global_batch=8)
    manifest = {"version": "v", "splits": {"val": {"samples": 100}}}
    assert plan(t, lay, manifest) == ({"every": 30, "batches": 3, "samples": 24, "split_samples": 100}, [])
    t.eval_samples, t.eval_every = 1000, 7
    got, notes = plan(t, lay, manifest)
    assert got["batches"] == 12 and got["every"] == 7 and "uses 96 of them" in notes[0], (got, notes)
    t.eval_samples, t.eval_every = 0, 0  # off (eval_every given with it: tests/test_loader_audit.py)
    assert plan(t, lay, manifest) == (None, [])


def test_early_stop_needs_validation(cfg):
    from tasks.errors import ConfigError

    with pytest.raises(ConfigError, match="train.early_stop_patience: 3 needs the validation loss"):
        configure(cfg, **{"train.early_stop_patience": 3, "train.eval_samples": 0})


def test_loss_plot_draws_both_curves():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.stages.train import loss_figure

    records = [
        {"step": s, "loss": 6.0 - s / 10, **({"val.loss": 6.5 - s / 20} if s % 2 == 0 else {})} for s in (1, 2, 3, 4)
    ]
    fig = loss_figure(records, plt)
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["train loss", "val loss", "best val 6.300 (step 4)"], labels
    assert list(fig.axes[0].lines[1].get_xdata()) == [2, 4]
    plt.close(fig)


def test_metrics_written_before_the_rename_are_read_under_todays_names(tmp_path):
    """A run resumed across issue 27's rename: its earlier records (`val_loss`, `val_time_s`) count as `val.loss` —
    the resume's history (best step, early stopping, progress), train.json and the loss plot."""
    from tasks.parallel.metrics import read_metrics
    from tasks.stages.train import validation_result

    path = tmp_path / "metrics.jsonl"
    old = [{"step": 1, "loss": 6.0, "val_loss": 6.4, "val_time_s": 0.1}, {"step": 2, "loss": 5.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*old, {"step": 3, "loss": 4.0, "val.loss": 6.5}]))
    records = read_metrics(path)
    assert records[0] == {"step": 1, "loss": 6.0, "val.loss": 6.4, "val.time_s": 0.1}, records
    got = validation_result(records, tmp_path)
    assert (got["val.loss"], got["val.best_loss"], got["val.best_step"]) == (6.5, 6.4, 1), got
