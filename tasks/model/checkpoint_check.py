"""A loaded checkpoint's first forward on the shard set, before any training: its own embedding, its first k blocks,
final norm and head, and the mean next-token loss against ln(vocab).

A uniform guess over V tokens scores ln(V); random weights score about that; a trained checkpoint read through its
own tokenizer scores far below it (a 7B model on ordinary text: 1–3 nats against ln(152064) = 11.9). One that does
not — shards tokenized with another tokenizer, a weight-name mapping that sends tensors to the wrong place, a file
cut short — fails here in one line instead of after hours of training from garbage.

Memory: the weights are read box by box from the safetensors files (tasks.model.init.HFWeights), one block resident
at a time in fp32 (the embedding is dropped before the head is read), and the head's logits are computed over a
chunk of positions at a time, so a 70B checkpoint's check holds one block plus one vocab × hidden matrix.
`layers` = 0 runs every block (streamed). Fewer blocks are faster, but the early layers of some families read
through the final norm and head (the "logit lens") predict poorly, so a short prefix may score near ln(V) even for
a good checkpoint: use it on families where it is known to work.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from tasks.errors import StageError
from tasks.model.init import HFWeights
from tasks.model.model_dir import check_tensor_names
from tasks.model.transformer import RMSNorm, TransformerBlock, embedding, rope_table

LOGIT_CHUNK = 512  # positions per head matmul: logits of [chunk, vocab] fp32 at a time


def check_files(source: HFWeights) -> None:
    """Every safetensors file opens and covers its header's tensors (safetensors refuses a file cut short:
    "incomplete metadata, file not fully covered")."""
    from safetensors import SafetensorError, safe_open

    files = {f for f, _ in source.where.values()} | {f for by_j in source.experts.values() for f, _ in by_j.values()}
    for file in sorted(files):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as e:
            raise StageError(
                f"model.hf_path: {file} is truncated or corrupt ({e}); copy the checkpoint again"
            ) from None


def _load(module: nn.Module, prefix: str, source: HFWeights, device) -> nn.Module:
    """Allocate `module` (built on meta) on `device` in fp32 and read each of its parameters from the checkpoint."""
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        source.fill(f"{prefix}{name}", p.data, tuple(p.shape), (0,) * p.dim())
    return module.eval()


def _meta(build):
    with torch.device("meta"):
        return build()


@torch.no_grad()
def initial_loss(path, tcfg, inputs: torch.Tensor, targets: torch.Tensor, layers: int = 0, device="cpu") -> dict:
    """Mean next-token loss of the checkpoint at `path` (config `tcfg`) on `inputs`/`targets` [b, s], through its
    embedding, first `layers` blocks (0 = all), final norm and head, in fp32 on `device`. Returns the loss, ln(V),
    their ratio, the blocks run, and the first block whose output was not finite (None when all were)."""
    start = time.perf_counter()
    check_tensor_names(path, tcfg)  # the index and every name checked (one line), as load_hf's and train's verify
    source = HFWeights(path, tcfg)
    check_files(source)
    k = tcfg.n_layers if layers <= 0 else min(layers, tcfg.n_layers)
    wanted = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(k):
        wanted += [f"layers.{i}.{n}" for n, _ in _meta(lambda: TransformerBlock(tcfg, i)).named_parameters()]
    source.check(wanted)  # one line naming the first tensor the checkpoint lacks

    x, y = inputs.to(device), targets.to(device)
    emb = _load(_meta(lambda: embedding(tcfg.vocab_size, tcfg.dim)), "tok_embeddings.", source, device)
    h = emb(x).float()
    del emb
    rope = rope_table(tcfg.head_dim, x.shape[1], tcfg.rope_theta, device=device)
    bad = None
    for i in range(k):
        block = _load(_meta(lambda: TransformerBlock(tcfg, i)), f"layers.{i}.", source, device)
        h = block(h, rope)
        del block
        if not torch.isfinite(h).all():
            bad = f"layers.{i}"
            break
    norm = _load(_meta(lambda: RMSNorm(tcfg.dim, tcfg.norm_eps)), "norm.", source, device)
    h = norm(h)
    head = _load(_meta(lambda: nn.Linear(tcfg.dim, tcfg.vocab_size, bias=False)), "output.", source, device)
    total = 0.0
    flat_h, flat_y = h.flatten(0, 1), y.flatten()
    for a in range(0, flat_y.numel(), LOGIT_CHUNK):
        logits = head(flat_h[a : a + LOGIT_CHUNK])
        total += F.cross_entropy(logits, flat_y[a : a + LOGIT_CHUNK], reduction="sum").item()
    loss = total / flat_y.numel()
    ln_v = math.log(tcfg.vocab_size)
    return {
        "loss": loss,
        "ln_vocab": ln_v,
        "ratio": loss / ln_v,
        "layers": k,
        "of_layers": tcfg.n_layers,
        "tokens": int(flat_y.numel()),
        "nonfinite_layer": bad,
        "seconds": round(time.perf_counter() - start, 3),
    }


def own_tokenizer(path, shard_dir=None) -> bool:
    """Whether the shard set is tokenized with the checkpoint's own tokenizer, decided as smoke and train decide it
    (tasks.model.hf_io.tokenizer_problem: an export's recorded identity, else its tokenizer.json): the checkpoint has
    one and, given `shard_dir`, the set's is it. Without `shard_dir` (smoke, which has already refused a set of
    another tokenizer by then), whether the checkpoint has one of its own."""
    from tasks.model.hf_io import tokenizer_problem
    from tasks.model.model_dir import accepted_tokenizers

    if not accepted_tokenizers(path):  # no tokenizer to compare with: the set's may be another one
        return False
    return shard_dir is None or tokenizer_problem(path, shard_dir) is None


def problem(result: dict, max_ratio: float, path, shard_dir=None) -> str | None:
    """One line when the checkpoint's initial loss is not far below ln(V) (None when it is). The fix named: the
    checkpoint's own tokenizer when the set may be of another (own_tokenizer), else smoke.hf_max_loss_ratio (a
    lightly trained checkpoint) or a config.json that does not match the weights."""
    loss, ln_v = result["loss"], result["ln_vocab"]
    if result["nonfinite_layer"] or not math.isfinite(loss):
        where = f" (first non-finite output: {result['nonfinite_layer']})" if result["nonfinite_layer"] else ""
        return (
            f"model.hf_path: the checkpoint's initial loss on the shard set is {loss}{where}: its weights hold "
            f"NaN/Inf or overflow in fp32; check the checkpoint ({path})"
        )
    if result["ratio"] <= max_ratio:
        return None
    blocks = "" if result["layers"] == result["of_layers"] else f" through its first {result['layers']} blocks"
    if own_tokenizer(path, shard_dir):
        fix = (
            f"the shard set already uses the checkpoint's own tokenizer: for a lightly trained checkpoint raise "
            f"smoke.hf_max_loss_ratio (now {max_ratio:g}) above {result['ratio']:.2f}, else check that config.json's "
            f"architecture matches the weights ({path})"
        )
    else:
        fix = (
            f"a trained checkpoint on its own tokenizer starts far below: shard with its own tokenizer "
            f"(data.tokenizer={path}) and check that config.json's architecture matches the weights"
        )
    return (
        f"model.hf_path: the checkpoint's initial loss on the shard set{blocks} is {loss:.3f} = "
        f"{result['ratio']:.0%} of ln(vocab {round(math.exp(ln_v))}) = {ln_v:.3f} (smoke.hf_max_loss_ratio "
        f"{max_ratio:g}); {fix}"
    )
