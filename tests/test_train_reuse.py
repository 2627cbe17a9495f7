"""A finished or interrupted run is handed back or resumed only for what it was trained on: the shard set (its
manifest digest in every checkpoint's meta.json), the training-shaping config (a finished run with other settings
is refused; an unfinished one resumes with a warning), and an HF export of its own final checkpoint (--fresh sets
hf/ aside; an export of another checkpoint is exported again). In-process: no worker is launched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.errors import ConfigError
from tests.helpers.train_fixture import configure, context, fake_run, shards  # noqa: F401


@pytest.fixture
def other_shards(tmp_path, shards):  # noqa: F811
    """The same shards and tokenizer under another manifest digest (another shard set to the checkpoint)."""
    other = tmp_path / "other-shards"
    shutil.copytree(shards, other)
    (other / "manifest.json").write_text((other / "manifest.json").read_text() + "\n")
    return other


def test_checkpoint_meta_records_the_shard_set(tmp_path, shards):  # noqa: F811
    from data_prep.manifest import digest
    from tasks.parallel.checkpoint import CheckpointManager

    class Loader:
        shard_dir = shards

        def state_dict(self):
            return {"position": 0}

    class Schedule:
        def state_dict(self):
            return {}

    mgr = CheckpointManager(tmp_path / "ckpt", keep=2, rank=0, coords={"dp": 0, "tp": 0, "pp": 0}, dp=1, world=1)
    _, _, meta = mgr._begin(3, [(None, Schedule())], Loader(), {})
    assert meta["manifest_digest"] == digest(shards) and meta["tokenizer"]


def test_resume_on_another_shard_set_is_refused(cfg, tmp_path, shards, other_shards):  # noqa: F811
    from data_prep.manifest import digest
    from tasks.stages import train

    c = configure(cfg)
    run = tmp_path / "run"
    ckpt = fake_run(c, run, shards, step=2)  # train.steps 5: an unfinished run
    assert train.prepare(c, context(run, shards))["resume_from"] == str(ckpt)
    with pytest.raises(ConfigError) as e:
        train.prepare(c, context(run, other_shards))
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint {ckpt} was trained on shard set {digest(shards)[:12]}" in msg
    assert f"{other_shards} is shard set {digest(other_shards)[:12]}" in msg
    assert "use --fresh to start over, or a new --run-dir" in msg


def test_checkpoint_without_a_recorded_shard_set_still_resumes(cfg, tmp_path, shards, other_shards):  # noqa: F811
    from tasks.stages import train

    c = configure(cfg)
    ckpt = fake_run(c, tmp_path / "run", shards, step=2, digest=False)  # written before digests were recorded
    assert train.prepare(c, context(tmp_path / "run", other_shards))["resume_from"] == str(ckpt)


def test_finished_run_on_another_shard_set_is_not_handed_back(cfg, tmp_path, shards, other_shards):  # noqa: F811
    from tasks.stages import train

    c = configure(cfg)
    fake_run(c, tmp_path / "run", shards, step=5)  # train.steps 5: finished
    assert train.run(c, context(tmp_path / "run", shards))["reused"] is True
    with pytest.raises(ConfigError, match=r"was trained on shard set .* use --fresh to start over, or a new --run-dir"):
        train.run(c, context(tmp_path / "run", other_shards))


def test_finished_run_with_changed_config_is_refused(cfg, tmp_path, shards, capsys):  # noqa: F811
    from tasks.stages import train

    c = configure(cfg)
    ckpt = fake_run(c, tmp_path / "run", shards, step=5)
    changed = configure(cfg, **{"train.lr": 1e-2, "train.seed": 7})
    with pytest.raises(ConfigError) as e:
        train.run(changed, context(tmp_path / "run", shards))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {ckpt} ends a finished run trained with other settings")
    assert "train.lr: 0.003 → 0.01" in msg and "train.seed:" in msg
    assert msg.endswith("use --fresh to start over, or a new --run-dir")
    assert "resuming from" not in capsys.readouterr().err  # nothing is resumed: no warning saying so
    # train.log_every does not shape training: the run is handed back
    assert train.run(configure(cfg, **{"train.log_every": 3}), context(tmp_path / "run", shards))["reused"] is True


def test_unfinished_run_with_changed_config_resumes_with_a_warning(cfg, tmp_path, shards):  # noqa: F811
    from tasks.stages import train

    c = configure(cfg)
    ckpt = fake_run(c, tmp_path / "run", shards, step=2)
    spec = train.prepare(configure(cfg, **{"train.lr": 1e-3}), context(tmp_path / "run", shards))
    assert spec["resume_from"] == str(ckpt)
    assert any(w.startswith("resuming from step-2 with training-shaping config changed") for w in spec["warnings"])


def test_fresh_sets_the_old_export_aside(cfg, tmp_path, shards):  # noqa: F811
    import argparse

    from tasks.runner import StageContext
    from tasks.stages import train

    c = configure(cfg)
    run = tmp_path / "run"
    fake_run(c, run, shards, step=5)
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")
    ctx = StageContext(run, "train", argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=True))
    train.prepare(c, ctx)
    assert not (run / "hf").exists() and (run / ".fresh-old" / "hf" / "config.json").is_file()


def _export(run: Path, source: Path | None) -> None:
    """hf/ as the export writes it: config.json, the weights and llm-pipeline.json recording their sizes and sha256
    (a rerun checks them) and `source` (None: an older export)."""
    from tasks.fsutil import sha256_file
    from tasks.model.model_dir import FORMAT, MANIFEST, file_entry
    from tests.helpers.models import LLAMA_CONFIG as LLAMA

    (run / "hf").mkdir(exist_ok=True)
    (run / "hf" / "config.json").write_text(json.dumps(LLAMA))
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (run / "hf" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    body = {"format": FORMAT, "files": {n: file_entry(run / "hf" / n) for n in ("config.json", "model.safetensors")}}
    if source is not None:
        body["checkpoint"] = {"name": source.name, "meta_sha256": sha256_file(source / "meta.json")}
    (run / "hf" / MANIFEST).write_text(json.dumps(body))


def test_an_export_of_another_checkpoint_is_not_handed_back(cfg, tmp_path, shards):  # noqa: F811
    from tasks.stages import train

    c = configure(cfg)
    run = tmp_path / "run"
    step4 = fake_run(c, run, shards, step=4)
    _export(run, step4)
    assert train.export_current(run, step4)
    step5 = run / "checkpoints" / "step-5"
    shutil.copytree(step4, step5)
    assert not train.export_current(run, step5)  # exported at step 4, trained on to step 5 with --no-export
    _export(run, step5)
    assert train.export_current(run, step5)
    (step5 / "meta.json").write_text(json.dumps({**json.loads((step5 / "meta.json").read_text()), "saved_at": 1}))
    assert not train.export_current(run, step5)  # another run's step-5 (an export that survived a --fresh)
    _export(run, None)
    assert train.export_current(run, step5)  # exported before the source was recorded: as before
    (run / "train").mkdir()
    (run / "train" / "summary.json").write_text(json.dumps({"export_from": str(step4)}))
    _export(run, step4)
    assert train.export_current(run, step5)  # early stopping exports its best checkpoint, not the last


@pytest.mark.slow
def test_finished_run_with_a_stale_export_exports_again(cfg, tmp_path, shards):  # noqa: F811
    """A real 2-step run (one rank, torchrun) exports; its hf/ recorded as another checkpoint's export (as after
    `--fresh --no-export` once left it) is not handed back: the rerun launches, resumes at the end and exports again."""
    from tasks.fsutil import atomic_write_json
    from tasks.model.model_dir import MANIFEST
    from tasks.stages import train

    c = configure(cfg, **{"train.steps": 2, "parallel.dp": 1, "hardware.nproc_per_node": 1})
    run = tmp_path / "run"
    first = train.run(c, context(run, shards, no_export=False))
    assert not first["reused"]
    manifest = run / "hf" / MANIFEST
    body = json.loads(manifest.read_text())
    assert body["checkpoint"]["name"] == "step-2"
    again = train.run(c, context(run, shards, no_export=False))
    assert again["reused"]  # the export of the final checkpoint: handed back
    atomic_write_json(manifest, {**body, "checkpoint": {**body["checkpoint"], "meta_sha256": "0" * 64}})
    stale = train.run(c, context(run, shards, no_export=False))
    assert not stale["reused"] and json.loads(manifest.read_text())["checkpoint"] == body["checkpoint"]


def test_the_export_records_its_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tasks.fsutil import sha256_file
    from tasks.model import build_model, materialize
    from tasks.model.config import get_preset
    from tasks.model.hf_export import export_from_checkpoint
    from tasks.model.model_dir import read_manifest, verify

    tcfg = get_preset("debug")
    tcfg.vocab_size = 512
    model = materialize(build_model(tcfg, "cpu"), "cpu", seed=0)
    ckpt = tmp_path / "step-3"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 3}))
    out = export_from_checkpoint(ckpt, tcfg, tmp_path / "hf")
    verify(out)
    assert read_manifest(out)["checkpoint"] == {"name": "step-3", "meta_sha256": sha256_file(ckpt / "meta.json")}
