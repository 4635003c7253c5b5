"""``mlp``: a multilayer perceptron for ``arrays`` data sets.

``x`` has shape ``(B, *sample_shape)`` and is flattened to ``(B, in_features)`` and cast to float32.
``task="classification"``: ``y`` holds class ids ``(B,)``, loss = mean cross-entropy.
``task="regression"``: ``y`` has shape ``(B, out_features)`` (or ``(B,)`` when ``out_features`` is 1),
loss = mean squared error over all outputs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crowdtrain.volunteer.models.recipe import Arg, ArgValue, TableRecipe, accuracy, uniform

MLP_ARGS = {
    "in_features": Arg(int, 32, "values per sample (the product of the data set's sample_shape)", min=1),
    "hidden": Arg(int, 64, "width of each hidden layer", min=1, max=1 << 20),
    "n_layer": Arg(int, 2, "hidden layers; 0 makes a linear model", min=0, max=256),
    "out_features": Arg(int, 10, "classes (classification) or outputs (regression)", min=1),
    "task": Arg(str, "classification", "loss to train", choices=("classification", "regression")),
    "seed": Arg(int, 0, "seed of the initial parameters", min=0, max=2**63 - 1),
    "batch_norm": Arg(bool, False, "BatchNorm after each hidden layer (its running statistics are state)"),
}


class MLPModel(nn.Module):
    def __init__(
        self,
        in_features: int,
        hidden: int,
        n_layer: int,
        out_features: int,
        task: str,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.task = task
        widths = [in_features] + [hidden] * n_layer
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.norms = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(n_layer)) if batch_norm else None
        self.head = nn.Linear(widths[-1], out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1).float()
        if x.shape[1] != self.in_features:
            raise ValueError(f"mlp expects {self.in_features} values per sample, got {x.shape[1]}")
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.norms is not None:
                norm = self.norms[i]
                # a micro-batch of one sample (the last of a peer's share) has no batch statistics: it is
                # normalised with the running ones, which it leaves as they are
                if x.shape[0] <= 1 and self.training and isinstance(norm, nn.BatchNorm1d):
                    x = F.batch_norm(
                        x, norm.running_mean, norm.running_var, norm.weight, norm.bias, training=False
                    )
                else:
                    x = norm(x)
            x = F.gelu(x)
        return self.head(x)


@dataclass(frozen=True, slots=True)
class MLPRecipe(TableRecipe):
    name: str = "mlp"
    kind: Any = "arrays"
    table: Any = field(default_factory=lambda: dict(MLP_ARGS))

    def _make(self, args: dict[str, ArgValue]) -> nn.Module:
        return MLPModel(
            int(args["in_features"]),
            int(args["hidden"]),
            int(args["n_layer"]),
            int(args["out_features"]),
            str(args["task"]),
            bool(args["batch_norm"]),
        )

    def _init(
        self, name: str, shape: tuple[int, ...], args: dict[str, ArgValue], generator: torch.Generator
    ) -> torch.Tensor:
        if name.startswith("norms."):  # BatchNorm's affine: PyTorch's default (weight 1, bias 0)
            return torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
        # PyTorch's default Linear init, drawn from the recipe's generator: U(±1/sqrt(fan_in)).
        fan_in = shape[1] if name.endswith(".weight") else None
        if fan_in is None:  # a bias: its layer's weight has the fan-in
            fan_in = self._fan_in(name, args)
        return uniform(shape, 1.0 / math.sqrt(fan_in), generator)

    @staticmethod
    def _fan_in(bias_name: str, args: dict[str, ArgValue]) -> int:
        if bias_name.startswith("layers.0."):
            return int(args["in_features"])
        if bias_name.startswith("head.") and args["n_layer"] == 0:
            return int(args["in_features"])
        return int(args["hidden"])

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if model.task == "classification":
            return F.cross_entropy(out.float(), y.reshape(-1).long())
        return F.mse_loss(out.float(), y.reshape(out.shape).float())

    def metrics(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Classification: the share of samples whose argmax is their class (reported on a held-out split)."""
        return accuracy(model, x, y) if model.task == "classification" else {}


MLP = MLPRecipe()
