"""Small models the tests build locally (nothing downloaded) and the logits of a training checkpoint.
torch and transformers are imported inside the functions, so importing this module costs nothing."""

from __future__ import annotations


def tiny_qwen2(path, vocab: int, seed: int = 0, **shape):
    """A small random Qwen2 saved by transformers (biases made non-zero, so the q/k/v bias mapping is tested)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        **{
            **dict(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=vocab,
                max_position_embeddings=128,
                tie_word_embeddings=False,
            ),
            **shape,
        }
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
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
