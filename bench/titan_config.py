"""torchtitan 0.3.0's own trainer on the model and batch of bench/gpu_train.py: the other side of its throughput
comparison. Loaded by torchtitan's entry point (a fully qualified --module is torchtitan's way to a custom config):

    torchrun --nproc-per-node 1 -m torchtitan.train --module bench.titan_config --config llama3_1b_synthetic

Shape, batch and steps come from the environment (TITAN_SEQ_LEN, TITAN_LOCAL_BATCH, TITAN_STEPS) so that no
torchtitan CLI flag has to be spelled here. The model is torchtitan's Llama 3 "1B" (models/llama3/__init__.py `_1b`:
dim 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocabulary 128256, tied embeddings), its default attention
(FlexAttention, block-causal from `positions`), AdamW, no activation checkpointing, no compile, no checkpoints. The
tokens are seeded random ids, like gpu_train.py's: one document per sequence (positions 0..seq_len-1, so the
block-causal mask is the causal one). Written against torchtitan 0.3.0's sources (the PyPI wheel: trainer.py
Trainer.Config, components/dataloader.py BaseDataLoader, components/tokenizer.py BaseTokenizer, config/manager.py);
needs torchtitan and a CUDA device, so it is only imported on a GPU host (`make device-check`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import TrainingConfig
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

VOCAB = 128256


class SyntheticTokenizer(BaseTokenizer):
    """The trainer builds a tokenizer; synthetic ids need none."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, **_):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args, **kwargs) -> list[int]:
        return []

    def decode(self, *args, **kwargs) -> str:
        return ""

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticDataLoader(BaseDataLoader):
    """Seeded random token windows, (input, positions) and labels as torchtitan's text loader yields them."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, dp_rank: int = 0, local_batch_size: int, seq_len: int, **_):
        self.vocab, self.batch, self.seq = config.vocab_size, local_batch_size, seq_len
        self.gen = torch.Generator().manual_seed(dp_rank)

    def __iter__(self):
        positions = torch.arange(self.seq).expand(self.batch, self.seq)
        while True:
            t = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen)
            yield {"input": t[:, :-1], "positions": positions}, t[:, 1:]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def llama3_1b_synthetic() -> Trainer.Config:
    spec = model_registry("1B")
    return Trainer.Config(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        tokenizer=SyntheticTokenizer.Config(),
        dataloader=SyntheticDataLoader.Config(),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=int(os.environ.get("TITAN_LOCAL_BATCH", "8")),
            seq_len=int(os.environ.get("TITAN_SEQ_LEN", "2048")),
            steps=int(os.environ.get("TITAN_STEPS", "15")),
            max_norm=1.0,
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        activation_checkpoint=None,
    )
