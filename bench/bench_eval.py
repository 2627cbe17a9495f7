"""Evaluation speed: the pipeline's lm-eval wrapper (tasks.harness.lm.ProjectLM) against lm-eval's own HFLM on the
same model, the same task and the same requests, in the same run.

The model is a small Qwen2 (dim 256, 4 layers, GQA 8/4, vocab 2048) built by transformers and saved locally; HFLM
loads it with transformers, the wrapper loads the same files into the project's Transformer. The task is
demo-continuation written from a small stdlib shard set's val split (300 examples, 4 choices, scored by
acc_mutual_info: 8 loglikelihood requests an example), 0-shot and 3-shot (longer shared contexts, where the wrapper
prefills a question's context once for all its choices). Both use batch size 16, one thread (as bench_quant: two
intra-op threads on a shared 2-core host measure each other's waits), and the two are timed alternately, the
better of two rounds counting. Every request's log-likelihood must agree with HFLM's (within 1e-3; the figure is
reported): a faster wrong answer is no figure. (The model is random, so its choices are near ties and the two
accuracies may differ by an example or two.)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

WORK = HERE / ".work" / "eval"
EXAMPLES, BATCH, ROUNDS = 300, 16, 2


def _model(shards: Path, out: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer

    from tests.helpers.models import tiny_qwen2  # the tests' Qwen2 builder (bench runs from the checkout)

    if (out / "config.json").is_file():
        return out
    eos = json.loads((shards / "manifest.json").read_text())["eos_token"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(shards / "tokenizer.json")), eos_token=eos
    )
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    tiny_qwen2(
        tmp,
        tokenizer=fast,
        bias_std=0,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    tmp.rename(out)
    return out


def _timed(lm, s) -> tuple[float, float, list[float]]:
    """(seconds, score, every request's log-likelihood in request order)."""
    from tasks.harness import suite

    t0 = time.perf_counter()
    r = suite.score(lm, s)
    seconds = time.perf_counter() - t0
    lls = [inst.resps[0][0] for task in s.loaded["tasks"].values() for inst in task.instances]
    return seconds, r["macro"], lls


def run() -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


def measure() -> dict:
    from data_prep.testing import tiny_shard_set
    from tasks.harness import demo_task, suite
    from tasks.harness.lm import ProjectLM
    from tasks.harness.models import full_precision, load_tokenizer
    from tasks.quant.gate import demo_keep

    WORK.mkdir(parents=True, exist_ok=True)
    shards = tiny_shard_set(WORK / "data", seq_len=128, vocab_size=2048, n_docs=300, val_fraction=0.1, shard_multiple=1)
    ckpt = _model(shards, WORK / "qwen2-small")
    yaml = demo_task.write(shards, WORK / "task", EXAMPLES, 0, demo_keep, "evaluation part")
    suite.offline()
    from lm_eval.models.huggingface import HFLM

    import transformers

    # The checkpoint's own tokenizer.json as it is: AutoTokenizer would pick Qwen2's tokenizer class from config.json
    # and put Qwen2's pre-tokenizer over this BPE (transformers 5), so the two would score different token ids.
    eos = json.loads((shards / "manifest.json").read_text())["eos_token"]
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"), eos_token=eos)
    hf = HFLM(
        pretrained=str(ckpt),
        tokenizer=tok,
        backend="causal",
        device="cpu",
        dtype="float32",
        batch_size=BATCH,
        max_length=512,
    )
    ours = ProjectLM(full_precision(ckpt, "fp32", "cpu"), load_tokenizer(ckpt), "cpu", BATCH, max_length=512)
    out = {"eval.examples": EXAMPLES, "eval.batch_size": BATCH, "eval.threads": 1}
    for shots in (0, 3):
        s = suite.load(["demo-continuation"], yaml, None, {"demo-continuation": shots}, ["acc_mutual_info"])
        best = {"hflm": float("inf"), "ours": float("inf")}
        scores, lls = {}, {}
        for _ in range(ROUNDS):
            for name, lm in (("hflm", hf), ("ours", ours)):
                seconds, scores[name], lls[name] = _timed(lm, s)
                best[name] = min(best[name], seconds)
        # A random model's choices are near ties, so accuracies may differ by a flip or two: the numbers must agree.
        diff = max(abs(a - b) for a, b in zip(lls["hflm"], lls["ours"], strict=True))
        if diff > 1e-3:
            raise AssertionError(f"{shots}-shot: log-likelihoods differ from HFLM's by up to {diff}")
        key = f"eval.{shots}shot"
        out[f"{key}.hflm_examples_per_s"] = round(EXAMPLES / best["hflm"], 1)
        out[f"{key}.wrapper_examples_per_s"] = round(EXAMPLES / best["ours"], 1)
        out[f"{key}.wrapper_speedup_vs_hflm"] = round(best["hflm"] / best["ours"], 2)
        out[f"{key}.hflm_accuracy"] = round(scores["hflm"], 4)
        out[f"{key}.wrapper_accuracy"] = round(scores["ours"], 4)
        out[f"{key}.max_loglikelihood_diff"] = float(f"{diff:.2g}")
    return out


if __name__ == "__main__":
    t0 = time.time()
    print(json.dumps(run(), indent=2), f"\n{time.time() - t0:.1f} s")
