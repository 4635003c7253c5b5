"""``tiny-gpt``: a byte-level causal transformer (nanoGPT's shape, dropout 0, no weight tying).

Its linear layers have no biases (nanoGPT's ``bias=False``): besides being a little faster, this removes the
attention key bias, whose true gradient is exactly zero (softmax ignores a constant shift), so its computed
gradient is pure rounding noise that AdamW would turn into order-dependent updates — which would break the
bit-for-bit agreement between volunteers' runs and the single-process reference.

Data: a ``tokens`` data set of bytes. A sample is a window of ``seq_len + 1`` tokens; ``x`` is its first
``seq_len`` tokens and ``y`` the next ``seq_len`` (shape ``(B, T)`` each, any integer dtype, ``T ≤ seq_len``).
The loss is the mean cross-entropy over all ``B·T`` predicted tokens, so each sample weighs the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crowdtrain.protocol.errors import RecipeError
from crowdtrain.volunteer.models.recipe import Arg, ArgValue, TableRecipe, normal

TINY_GPT_ARGS = {
    "d_model": Arg(int, 64, "width of the residual stream", min=8, max=8192),
    "n_layer": Arg(int, 2, "transformer blocks", min=1, max=256),
    "n_head": Arg(int, 4, "attention heads; must divide d_model", min=1, max=256),
    "seq_len": Arg(int, 64, "context length in tokens", min=2, max=65536),
    "vocab": Arg(int, 256, "vocabulary size; 256 for byte-level tokens", min=2, max=1 << 20),
    "seed": Arg(int, 0, "seed of the initial parameters", min=0, max=2**63 - 1),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)
        self.c_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.c_proj = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, d_model: int, n_layer: int, n_head: int, seq_len: int, vocab: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids ``idx`` of shape ``(B, T)``."""
        if idx.dim() != 2 or idx.shape[1] > self.seq_len:
            raise ValueError(
                f"tiny-gpt takes token ids of shape (batch, ≤{self.seq_len}), got {tuple(idx.shape)}"
            )
        idx = idx.long()
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True, slots=True)
class TinyGPTRecipe(TableRecipe):
    name: str = "tiny-gpt"
    kind: Any = "tokens"
    table: Any = field(default_factory=lambda: dict(TINY_GPT_ARGS))

    def _check(self, args: dict[str, ArgValue]) -> None:
        if int(args["d_model"]) % int(args["n_head"]):
            raise RecipeError(
                f"Recipe 'tiny-gpt': n_head ({args['n_head']}) must divide d_model ({args['d_model']}); "
                "fix model.args in the run spec."
            )

    def _make(self, args: dict[str, ArgValue]) -> nn.Module:
        d_model, n_layer, n_head, seq_len, vocab = (
            int(args[k]) for k in ("d_model", "n_layer", "n_head", "seq_len", "vocab")
        )
        return TinyGPT(d_model, n_layer, n_head, seq_len, vocab)

    def _init(
        self, name: str, shape: tuple[int, ...], args: dict[str, ArgValue], generator: torch.Generator
    ) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if ".ln_" in name or name.startswith("ln_"):
            return torch.ones(shape)
        std = 0.02
        if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
            std = 0.02 / math.sqrt(2 * int(args["n_layer"]))
        return normal(shape, std, generator)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1).long())


TINY_GPT = TinyGPTRecipe()
