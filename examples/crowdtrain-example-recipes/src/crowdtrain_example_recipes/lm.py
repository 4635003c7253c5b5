"""``example-lm``: a small recurrent language model on a ``tokens`` data set.

A micro-batch reaches the model as ``x`` int64 ``(B, seq_len)`` and ``y`` int64 ``(B, seq_len)``: two windows
of the token stream, ``y`` shifted one token ahead of ``x``. A token recipe names its context length
``seq_len`` (the sampler cuts windows of ``seq_len + 1`` tokens) and its vocabulary size ``vocab`` (every
token id of the data set must be below it; ``run create`` checks).
"""

from __future__ import annotations

import torch
from torch import nn

from crowdtrain.volunteer.models import Arg, wrap


class TinyGRU(nn.Module):
    """Embedding → one GRU layer → Linear: per-token logits ``(B, T, vocab)``."""

    def __init__(self, vocab: int = 256, seq_len: int = 64, d_model: int = 64) -> None:
        super().__init__()
        self.seq_len = seq_len  # not a layer's size: a GRU takes any length; kept to refuse longer inputs
        self.embed = nn.Embedding(vocab, d_model)
        self.rnn = nn.GRU(d_model, d_model, batch_first=True)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.seq_len:
            raise ValueError(f"example-lm takes at most {self.seq_len} tokens, got {x.shape[1]}")
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


RECIPE = wrap(
    "example-lm",
    "tokens",
    TinyGRU,
    loss="cross_entropy",  # mean over every token of the micro-batch
    args={
        "vocab": Arg(int, 256, "vocabulary size; every token id must be below it (256 for bytes)", min=2),
        "seq_len": Arg(int, 64, "tokens of context per training window", min=1, max=4096),
        "d_model": Arg(int, 64, "width of the embedding and of the GRU's state", min=1, max=4096),
    },
    metrics="accuracy",  # share of next tokens predicted exactly
)
