"""Small models the tests build locally (nothing downloaded) and the logits of a training checkpoint.
torch and transformers are imported inside the functions, so importing this module costs nothing."""

from __future__ import annotations

from pathlib import Path


def stdlib_bpe(vocab: int = 384):
    """A byte-level BPE of `vocab` tokens trained on three standard-library files, as transformers' fast tokenizer
    (eos `<|endoftext|>`): a tokenizer of a checkpoint's own, built in a second."""
    import sysconfig

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok.train([str(stdlib / name) for name in ("textwrap.py", "string.py", "bisect.py")], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def tiny_qwen2(path, vocab: int = 0, seed: int = 0, tokenizer=None, bias_std: float = 0.1, **shape):
    """A small random Qwen2 built and saved by transformers (dim 64, 2 layers, GQA 4/2 unless `shape` says
    otherwise). With `tokenizer` (a fast tokenizer), its vocabulary and eos are the model's and it is saved beside.
    Biases ~ N(0, bias_std) (HF zero-inits them: non-zero, the q/k/v bias mapping is really exercised; 0 keeps
    them zero)."""
    import torch
    import transformers

    if tokenizer is not None:
        vocab = len(tokenizer)
        shape.setdefault("eos_token_id", tokenizer.eos_token_id)
        tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(**{**base, **shape}), dtype=torch.float32
    ).eval()
    if bias_std:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, bias_std)
    model.save_pretrained(path)
    return model


def trained_tiny_qwen2(path, tokenizer, steps: int = 150):
    """tiny_qwen2 (zero biases) on `tokenizer`'s vocabulary, trained for `steps` steps on standard-library sources
    (as the demo shard set is) and saved again: a real checkpoint, whose first loss on the shard set is far below
    ln(vocab), as smoke checks."""
    import sysconfig

    import torch

    model = tiny_qwen2(path, tokenizer=tokenizer, bias_std=0).train()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids = torch.tensor(
        [i for f in sorted(stdlib.glob("*.py"))[:40] for i in tokenizer(f.read_text(errors="replace"))["input_ids"]]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=gen)
        window = torch.stack([ids[i : i + 65] for i in starts.tolist()])
        logits = model(window[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(path)
    return model


def logits_of_checkpoint(ckpt, tcfg, tokens):
    """Our model, loaded whole from the training checkpoint in this process (the reference for the export)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tasks.model import build_model

    model = build_model(tcfg, "meta").to_empty(device="cpu")  # no random init: every weight is read below
    model.tie_weights()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state["model"])
    model.init_rope()
    with torch.no_grad():
        return model(tokens)


def tied_output_peaks() -> dict:
    """{"Linear": peak, "TiedOutput": peak}: the RSS high-water mark of one backward through a tied output
    projection, in units of vocab × hidden fp32 (the tensors are mmapped, > 32 MB), with the plain Linear and with
    TiedOutput, and whether their embedding gradients are bit-identical. Meant for a fresh process
    (tests/test_model.py runs it in one): in a long-lived test worker, pages earlier tests freed can be reused without
    raising the RSS, and the peak then reads short."""
    import dataclasses
    import gc

    import torch
    from torch import nn

    from tasks.device import memory_stats, reset_peak
    from tasks.model import build_model, get_preset, lm_loss, materialize
    from tasks.model.transformer import TiedOutput

    tcfg = dataclasses.replace(
        get_preset("debug"),
        dim=512,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=64,
        n_layers=1,
        vocab_size=32768,
        tie_embeddings=True,
    )
    model = materialize(build_model(tcfg, "meta"), "cpu", 0)
    assert type(model.output) is TiedOutput and model.output.weight is model.tok_embeddings.weight
    x = torch.randint(0, tcfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    unit = tcfg.vocab_size * tcfg.dim * 4
    grads, peaks = {}, {}
    for cls in (nn.Linear, TiedOutput):
        model.output.__class__ = cls
        for _ in range(2):  # the second pass: nothing first-time in the peak
            model.zero_grad(set_to_none=True)
            gc.collect()
            loss = lm_loss(model(x), x)
            reset_peak(torch.device("cpu"))
            start = memory_stats(torch.device("cpu"))["allocated_bytes"]
            loss.backward()
            peaks[cls.__name__] = (memory_stats(torch.device("cpu"))["peak_bytes"] - start) / unit
        grads[cls.__name__] = model.tok_embeddings.weight.grad.clone()
    return {**peaks, "identical": bool(torch.equal(grads["Linear"], grads["TiedOutput"]))}


# A small Llama config.json as transformers reads it (a valid export's config for tests that write hf/ by hand).
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}
