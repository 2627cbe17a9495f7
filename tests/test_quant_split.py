"""Calibration and evaluation draw disjoint tokens from the val split, by a recorded rule."""

from __future__ import annotations

import pytest
import torch

from tasks.errors import StageError
from tasks.quant import inputs
from tasks.quant.quality import drops
from tests.helpers.quant_fixture import tiny_trained


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_trained(tmp_path_factory.getbasetemp())


def test_calibration_and_evaluation_are_disjoint(tiny):
    calib, c = inputs.val_part(tiny["shard_dir"], 1000, 4, "calibration")
    evals, e = inputs.val_part(tiny["shard_dir"], 1000, 4, "evaluation")
    assert c["rule"] == e["rule"] == inputs.SPLIT_RULE
    assert c["sequences"] > 0 and e["sequences"] > 0
    assert not set(c["keys"]) & set(e["keys"])  # no window in both parts
    assert all(k % inputs.SPLIT_EVERY == 0 for k in c["keys"]) and all(k % inputs.SPLIT_EVERY for k in e["keys"])
    rows = lambda batches: {tuple(row.tolist()) for x, _ in batches for row in x}  # noqa: E731
    assert not rows(calib) & rows(evals)  # and no sequence of tokens either
    assert sum(x.shape[0] for x, _ in calib) == c["sequences"] and e["tokens"] == sum(t.numel() for _, t in evals)
    # the same call gives the same tokens (file order, no shuffle): every model is measured on the same data
    again, e2 = inputs.val_part(tiny["shard_dir"], 1000, 4, "evaluation")
    assert e2["keys_digest"] == e["keys_digest"] and torch.equal(again[0][0], evals[0][0])
    # a limit: the first n batches of that part
    two, info = inputs.val_part(tiny["shard_dir"], 2, 4, "evaluation")
    assert len(two) == 2 and info["keys"] == e["keys"][:8]


def test_empty_part_fails_in_one_line(tmp_path):
    from data_prep.testing import tiny_shard_set

    shards = tiny_shard_set(tmp_path / "d", seq_len=16, vocab_size=300, n_docs=4, val_fraction=0.0, shard_multiple=1)
    with pytest.raises(StageError, match=r"^evaluation set is empty: .* reshard with a larger data.val_fraction"):
        inputs.val_part(shards, 2, 2, "evaluation")


def test_gate_figures_by_hand():
    ref = {"ppl": 10.0, "accuracy": 0.5, "continuations": [[1, 2, 3, 4], [5, 6]]}
    q = {"ppl": 10.5, "accuracy": 0.49, "continuations": [[1, 2, 0, 4], [5, 0]]}
    g = drops(ref, q)
    assert g["ppl_drop_pct"] == pytest.approx(5.0) and g["accuracy_drop_pct"] == pytest.approx(2.0)
    assert g["greedy_agreement"] == pytest.approx(4 / 6) and g["greedy_disagreement_pct"] == pytest.approx(100 / 3)
    assert g["agreement_tokens"] == 6
    assert "greedy_agreement" not in drops(dict(ref, continuations=[]), dict(q, continuations=[]))
