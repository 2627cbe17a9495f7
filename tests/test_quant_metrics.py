"""Evaluation metrics against hand computations on tiny cases."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from tasks.quant import metrics


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, max_seq_len: int, device) -> list[int]:
    """The oracle for the KV-cache decoder: argmax decoding re-running the whole context (cut to the window)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ctx = torch.tensor([ids[-max_seq_len:]], device=device)
        ids.append(int(model(ctx)[0, -1].argmax()))
    return ids[len(prompt_ids) :]


class FixedLogits(torch.nn.Module):
    """Logits that depend only on the input token: row `t` of a table (a bigram model, easy to compute by hand)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.tensor(table, dtype=torch.float32)

    def forward(self, tokens):
        return self.table[tokens]


def test_perplexity_matches_hand_computation():
    # Vocabulary of 3. After token 0 the model says p = (1/2, 1/4, 1/4); after token 1, uniform thirds.
    model = FixedLogits([[math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    inputs = torch.tensor([[0, 0, 1]])
    targets = torch.tensor([[0, 1, 2]])
    # NLLs: -ln(1/2), -ln(1/4), -ln(1/3) → mean (ln2 + ln4 + ln3) / 3 = ln(24) / 3 → ppl = 24^(1/3)
    got = metrics.perplexity(model, [(inputs, targets)], "cpu")
    assert got["tokens"] == 3
    assert got["ppl"] == pytest.approx(24 ** (1 / 3), rel=1e-6)
    # Two batches weigh by tokens, not by batch: a 1-token batch adds -ln(1/3).
    two = metrics.perplexity(model, [(inputs, targets), (torch.tensor([[1]]), torch.tensor([[0]]))], "cpu")
    assert two["ppl"] == pytest.approx(math.exp((math.log(24) + math.log(3)) / 4), rel=1e-6)
    with pytest.raises(ValueError, match="zero tokens"):
        metrics.perplexity(model, [], "cpu")


def test_uniform_model_has_perplexity_of_vocabulary():
    model = FixedLogits([[0.0] * 7] * 7)
    batch = (torch.randint(0, 7, (2, 5)), torch.randint(0, 7, (2, 5)))
    assert metrics.perplexity(model, [batch], "cpu")["ppl"] == pytest.approx(7.0, rel=1e-6)


def test_greedy_generation_follows_argmax():
    # After t the argmax is (t + 1) % 3.
    model = FixedLogits([[0, 1, 0], [0, 0, 1], [1, 0, 0]])
    assert greedy_generate(model, [0], 5, max_seq_len=4, device="cpu") == [1, 2, 0, 1, 2]


def test_sizes(tmp_path):
    lin = torch.nn.Linear(64, 64, bias=False)
    fp32, bf16 = metrics.state_dict_bytes(lin, torch.float32), metrics.state_dict_bytes(lin, torch.bfloat16)
    assert fp32 > 64 * 64 * 4 and bf16 > 64 * 64 * 2 and fp32 - bf16 == pytest.approx(64 * 64 * 2, rel=0.05)
    # tied embeddings: one tensor under two names, cast and counted once (as the BF16 model saves), not twice
    from tasks.model import build_model, get_preset, materialize

    tied = materialize(build_model(dataclasses.replace(get_preset("debug"), tie_embeddings=True)), "cpu", seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    as_bf16 = metrics.state_dict_bytes(copy.deepcopy(tied).to(torch.bfloat16))
    assert metrics.state_dict_bytes(tied, torch.bfloat16) == pytest.approx(as_bf16, rel=1e-3)
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y" * 5)
    assert metrics.size_on_disk(tmp_path / "a") == 10 and metrics.size_on_disk(tmp_path) == 15


def test_accuracy_and_agreement_by_hand():
    # After t the argmax is (t + 1) % 3; targets follow it on 2 of 3 positions.
    model = FixedLogits([[0, 1, 0], [0, 0, 1], [1, 0, 0]])
    got = metrics.perplexity(model, [(torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, 2]]))], "cpu")
    assert got["accuracy"] == pytest.approx(2 / 3)
    assert metrics.agreement([[1, 2, 3], [4, 5]], [[1, 0, 3], [4, 5]]) == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match="zero tokens"):
        metrics.agreement([], [])


def test_kv_cache_decoding_matches_full_forward():
    """The cached prefill + single-token steps give the full forward's logits, and the same greedy tokens as
    re-running the whole context each step."""
    from tasks.model import build_model, get_preset, materialize
    from tasks.model.generate import forward_cached, greedy

    model = materialize(build_model(get_preset("debug"), "cpu"), "cpu", seed=0).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = {}
    head = forward_cached(model, tokens[:, :8], cache, 0)
    tail = torch.cat([forward_cached(model, tokens[:, i : i + 1], cache, i) for i in range(8, 12)], dim=1)
    with torch.no_grad():
        full = model(tokens)
    assert torch.allclose(torch.cat([head, tail], dim=1), full, atol=1e-4)
    new = greedy(model, tokens[:1, :5], 6)[0].tolist()
    assert new == greedy_generate(model, tokens[0, :5].tolist(), 6, model.config.max_seq_len, "cpu")
    speed = metrics.generation_speed({"a": model}, tokens[:, :4], 4, "cpu", repeats=1, warmup=0)
    assert speed["a"]["prefill_s"] > 0 and speed["a"]["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        greedy(model, tokens[:1], model.config.max_seq_len)
