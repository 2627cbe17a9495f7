"""Next-token figures on the evaluation part of the val split (disjoint from calibration: inputs.SPLIT_RULE):
perplexity, top-1 accuracy and greedy continuations (KV cache) — supplementary to the task accuracy, and gates in
their own right when evaluate.gate_metric names one of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tasks.quant import inputs


@dataclass
class EvalData:
    batches: list  # evaluation part of the val split
    split: dict  # its record (rule, count, window indices)
    windows: object = None  # [k, prompt_len] prompts cut from the first evaluation windows
    prompts: list = field(default_factory=list)  # token ids of evaluate.prompts
    prompt_texts: list = field(default_factory=list)
    new_tokens: int = 0


def eval_data(cfg, shard_dir: Path, max_seq_len: int) -> EvalData:
    import torch
    from tokenizers import Tokenizer

    e = cfg.evaluate
    batches, split = inputs.val_part(shard_dir, e.eval_batches, cfg.train.micro_batch, "evaluation")
    data = EvalData(batches, split, new_tokens=max(1, min(e.max_new_tokens, max_seq_len // 2)))
    if e.agreement_windows:
        rows = torch.cat([b[0] for b in batches])[: e.agreement_windows]
        data.windows = rows[:, : min(rows.size(1) // 2, max_seq_len - data.new_tokens)]
    tok = Tokenizer.from_file(str(shard_dir / "tokenizer.json"))
    for text in e.prompts:
        ids = tok.encode(text).ids[-(max_seq_len - data.new_tokens) :]
        if ids:
            data.prompts.append(ids)
            data.prompt_texts.append(text)
    return data


def quality(model, data: EvalData, device) -> dict:
    """Perplexity and top-1 accuracy over the evaluation tokens, and the greedy continuations (KV cache)."""
    import torch

    from tasks.model.generate import greedy
    from tasks.quant import metrics

    scores = metrics.perplexity(model, data.batches, device)
    conts = []
    if data.windows is not None:
        conts += greedy(model, data.windows.to(device), data.new_tokens).tolist()
    conts += [greedy(model, torch.tensor([ids], device=device), data.new_tokens)[0].tolist() for ids in data.prompts]
    return dict(scores, continuations=conts)


def drops(ref: dict, q: dict) -> dict:
    """The INT8 model's next-token drops against the reference, in percent (positive: INT8 is worse)."""
    from tasks.quant import metrics

    out = {
        "ppl_drop_pct": (q["ppl"] - ref["ppl"]) / ref["ppl"] * 100.0,
        "accuracy_drop_pct": (ref["accuracy"] - q["accuracy"]) / ref["accuracy"] * 100 if ref["accuracy"] else 0.0,
    }
    if ref["continuations"]:
        agree = metrics.agreement(ref["continuations"], q["continuations"])
        out.update(
            greedy_agreement=agree,
            greedy_disagreement_pct=(1 - agree) * 100,
            agreement_tokens=sum(len(c) for c in ref["continuations"]),
        )
    return out


def finite_logits(model, inputs, device) -> bool:
    """Whether `model`'s logits on `inputs` (one batch of token ids) are all finite: NaN logits give a NaN perplexity,
    and task scores that are the same for every such model (a drop of 0)."""
    import torch

    with torch.no_grad():
        return bool(torch.isfinite(model(inputs.to(device))).all())


def reference_problem(what: str, dtype: str, figure: str = "its logits on val tokens") -> str:
    """One line for a reference (the unquantized model every INT8 model is judged against) whose outputs are not
    finite: the gate would compare NaN with NaN. Its weights are finite (tasks.model.hf_io.load_hf refuses others)."""
    fix = "the checkpoint is corrupt or its training diverged: re-export it, or use another (an earlier) checkpoint"
    if dtype == "fp16":
        fix = f"FP16 overflows where BF16 does not: set quantize.dtype=bf16; else {fix}"
    return f"{what}: {figure} are not finite (NaN or infinity), so no INT8 model can be judged against it; {fix}"
