"""Layout keys the plan once ignored though training honours them: an explicit parallel.microbatches (training keeps
it: tasks.layout.EXPLICIT_LAYOUT) and parallel.recompute_every (tasks/parallel/ac.py wraps only every k-th layer)."""

from __future__ import annotations

import dataclasses

import pytest

from tasks.errors import StageError
from tasks.fsutil import read_json
from tasks.layout import Layout
from tasks.runner import run_stage


def plan_of(tmp_path, config: str, sets=()):
    from tasks.config import load_config

    c = load_config(config, sets=list(sets))
    c.tracking.enabled = False
    return run_stage("plan", c, tmp_path), c


def test_an_explicit_microbatches_is_the_only_split_the_plan_sizes(tmp_path):
    """`--set parallel.microbatches=4`: the plan once chose and sized mb1×16 (llama3-8b on 2×8 910B) while training,
    keeping the 4, ran 4 micro-batches of 4 sequences: the feasibility verdict was for another layout."""
    from tasks.layout import resolve
    from tasks.planner.memory import estimate
    from tasks.shape import TransformerConfig

    result, cfg = plan_of(tmp_path, "llama3-8b-910b-2node", sets=["parallel.microbatches=4"])
    saved = read_json(result["plan_json"])
    assert saved["plans"] and {p["microbatches"] for p in saved["plans"]} == {4}
    assert all(p["micro_batch"] * 4 * p["dp"] == 128 for p in saved["plans"])
    chosen = result["parallel"]
    assert chosen["microbatches"] == 4
    lay = resolve(cfg, result, 16)  # what training runs
    assert (lay.n_microbatches, lay.local_batch // lay.n_microbatches) == (4, chosen["micro_batch"])
    run = dataclasses.replace(lay, micro_batch=lay.local_batch // lay.n_microbatches)  # as the train stage sizes it
    est = estimate(TransformerConfig.from_preset("llama3-8b"), cfg.data.seq_len, run, "bf16", "adamw")
    assert est["activations_bytes"] == pytest.approx(result["best"]["activations_bytes"])


def test_microbatches_and_micro_batch_together_plan_the_dp_they_agree_on(tmp_path):
    result, _ = plan_of(tmp_path, "llama3-8b-910b-2node", sets=["parallel.microbatches=4", "train.micro_batch=4"])
    saved = read_json(result["plan_json"])
    assert {(p["dp"], p["micro_batch"], p["microbatches"]) for p in saved["plans"]} == {(8, 4, 4)}


@pytest.mark.parametrize(
    "sets, match",
    [
        (
            ["parallel.microbatches=3"],
            r"^parallel\.microbatches: 3 does not divide train\.global_batch 128 / parallel\.dp ",
        ),
        (
            ["parallel.microbatches=3", "parallel.dp=16"],
            r"^parallel\.microbatches: 3 does not divide the 8 sequences per dp rank \(train\.global_batch 128 / "
            r"parallel\.dp 16\); set it to a divisor",
        ),
        (
            ["parallel.microbatches=4", "train.micro_batch=4", "parallel.dp=16"],
            r"^parallel\.microbatches: 4 micro-batches of train\.micro_batch 4 do not make the 8 sequences per dp "
            r"rank .*; set one so that train\.micro_batch × parallel\.microbatches",
        ),
    ],
)
def test_a_microbatches_that_cannot_split_the_batch_is_refused_in_one_line(tmp_path, sets, match):
    with pytest.raises(StageError, match=match) as e:
        plan_of(tmp_path, "llama3-8b-910b-2node", sets=sets)
    assert "\n" not in str(e.value)


def test_the_moe_plan_sizes_an_explicit_microbatches_too(tmp_path):
    result, _ = plan_of(tmp_path / "ok", "qwen2-57b-a14b-910b", sets=["parallel.microbatches=2"])  # 2 per dp rank
    saved = read_json(result["plan_json"])
    assert {(p["micro_batch"], p["microbatches"]) for p in saved["plans"]} == {(1, 2)}
    with pytest.raises(StageError, match=r"^parallel\.microbatches: 4 does not divide the 2 sequences per dp rank"):
        plan_of(tmp_path / "bad", "qwen2-57b-a14b-910b", sets=["parallel.microbatches=4"])


def _wrapped_per_stage(tcfg, lay: Layout) -> list[tuple[int, int]]:
    """(layers, wrapped) per pipeline rank, as the trainer builds them (tasks/train/build.py: split, then apply_ac)."""
    from tasks.layout import stages_per_rank
    from tasks.model.transformer import build_model
    from tasks.parallel.ac import apply_ac
    from tasks.parallel.pp import split_model

    out = []
    for rank in range(lay.pp):
        parts = split_model(build_model(tcfg), rank, lay.pp, stages_per_rank(lay.pp_schedule, lay.virtual_stages))
        out.append(
            (
                sum(len(p.layers) for _, p in parts),
                sum(apply_ac(p, lay.recompute, lay.recompute_every) for _, p in parts),
            )
        )
    return out


@pytest.mark.parametrize(
    "pp, schedule, every",
    [(1, "1f1b", 4), (4, "1f1b", 3), (2, "interleaved1f1b", 3), (3, "1f1b", 2), (1, "1f1b", 1)],
)
def test_the_estimate_counts_the_layers_recompute_every_wraps(pp, schedule, every):
    """parallel.recompute_every k: the trainer checkpoints only layers whose global index is a multiple of k; the
    estimate once counted every layer as recomputed (full and full every 4 came out the same)."""
    from tasks.planner.memory import layer_activation_bytes, rank_layers, recomputed_share, stage_breakdown
    from tasks.shape import TransformerConfig

    tcfg = TransformerConfig(dim=64, n_layers=12, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64)
    lay = Layout(pp=pp, recompute="full", recompute_every=every, pp_schedule=schedule, microbatches=8, micro_batch=1)
    for rank, (n, wrapped) in enumerate(_wrapped_per_stage(tcfg, lay)):
        assert len(rank_layers(tcfg.n_layers, lay, rank)) == n
        assert recomputed_share(tcfg.n_layers, lay, rank) * n == pytest.approx(wrapped)
    # the activations: wrapped layers keep their input, the others everything
    s = 32
    full = layer_activation_bytes(s, 1, 64, 4, recompute="full", ffn=128, gated=True, flash=True, kv=2)
    none = layer_activation_bytes(s, 1, 64, 4, recompute="none", ffn=128, gated=True, flash=True, kv=2)
    every_layer = dataclasses.replace(lay, recompute_every=1)
    for rank in range(pp):
        share = recomputed_share(tcfg.n_layers, lay, rank)
        got = stage_breakdown(tcfg, s, lay, rank, "bf16")["activations_bytes"]
        base = stage_breakdown(tcfg, s, every_layer, rank, "bf16")["activations_bytes"]
        assert got - base == pytest.approx((1 - share) * (none - full) * (tcfg.n_layers / pp) * _flight(lay, rank))
        assert (got > base) == (every > 1)


def _flight(lay: Layout, stage: int) -> float:
    from tasks.planner.memory import in_flight

    return in_flight(lay.pp_schedule, lay.pp, lay.n_microbatches, stage, lay.virtual_stages)


def test_the_plan_and_the_train_stage_estimate_size_recompute_every(tmp_path):
    """`--set parallel.recompute=full parallel.recompute_every=4`: the plan once sized it as recompute on every layer
    (llama3-8b, dp16 zero2 mb2×4: 41.559 s, 15.991 GB of activations either way); so did the train stage's rehearsal
    estimate (tasks/stages/train._estimate), which goes through the same planner.memory.estimate."""
    from tasks.layout import resolve
    from tasks.shape import TransformerConfig
    from tasks.stages.train import _estimate

    pin = ["parallel.dp=16", "parallel.tp=1", "parallel.pp=1", "parallel.zero=2", "train.micro_batch=2"]
    every1, cfg1 = plan_of(tmp_path / "1", "llama3-8b-910b-2node", sets=[*pin, "parallel.recompute=full"])
    every4, cfg4 = plan_of(
        tmp_path / "4", "llama3-8b-910b-2node", sets=[*pin, "parallel.recompute=full", "parallel.recompute_every=4"]
    )
    b1, b4 = every1["best"], every4["best"]
    assert b1["activations_bytes"] / 1e9 == pytest.approx(15.991, abs=1e-3) and b1["step_s"] == pytest.approx(
        41.559, abs=1e-3
    )
    assert b4["activations_bytes"] > 4 * b1["activations_bytes"]  # 24 of 32 layers keep everything
    assert b4["step_s"] < b1["step_s"]  # 8 of 32 layers run their forward again, not 32
    assert read_json(every4["plan_json"])["chosen"]["recompute_every"] == 4
    tcfg = TransformerConfig.from_preset("llama3-8b")
    e1 = _estimate(cfg1, tcfg, resolve(cfg1, every1, 16), "npu")
    e4 = _estimate(cfg4, tcfg, resolve(cfg4, every4, 16), "npu")
    assert e4 - e1 == pytest.approx(b4["activations_bytes"] - b1["activations_bytes"], rel=1e-9)


def test_the_moe_estimate_counts_the_layers_recompute_every_wraps():
    from tasks.planner import moe
    from tasks.shape import TransformerConfig

    tcfg = TransformerConfig.from_preset("qwen2-57b-a14b")
    est = {
        (rc, k): moe.estimate_for_run(tcfg, 4096, 1, dp=32, ep=8, zero=3, recompute=rc, recompute_every=k)
        for rc, k in (("none", 1), ("full", 1), ("full", 2), ("full", 4))
    }
    assert est["full", 1] < est["full", 2] < est["full", 4] < est["none", 1]
    # of the 28 layers, every 2nd keeps 14 layers' activations whole, every 4th 21 (0, 4, …, 24 are wrapped)
    assert (est["full", 4] - est["full", 1]) / (est["full", 2] - est["full", 1]) == pytest.approx(21 / 14, rel=1e-6)


def test_the_train_stages_moe_estimate_sizes_recompute_every():
    """The rehearsal's MoE estimate (tasks/stages/train._estimate) passes the layout's recompute_every on, as the
    dense one does: checkpointing every 4th layer holds more than every layer, by what the MoE planner counts."""
    import dataclasses

    from tasks.config import load_config
    from tasks.layout import Layout
    from tasks.planner import moe
    from tasks.shape import TransformerConfig
    from tasks.stages.train import _estimate

    tcfg = TransformerConfig.from_preset("qwen2-57b-a14b")
    cfg = load_config("demo-cpu")
    cfg.data.seq_len = 4096
    lay = Layout(dp=32, ep=8, zero=3, recompute="full", micro_batch=1, global_batch=32)
    got = {k: _estimate(cfg, tcfg, dataclasses.replace(lay, recompute_every=k), "npu") for k in (1, 4)}
    want = {
        k: moe.estimate_for_run(
            tcfg, 4096, 1, dp=32, ep=8, zero=3, recompute="full", precision=cfg.train.precision, recompute_every=k
        )
        for k in (1, 4)
    }
    assert got[4] - got[1] == want[4] - want[1] > 0
