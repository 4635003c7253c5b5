"""``example-cnn``: a small convolutional network for 8×8 one-channel images with class labels.

The data set is an ``arrays`` set made from a ``.npz`` whose ``x`` is float32 of shape ``(N, 1, 8, 8)`` and
whose ``y`` is int64 of shape ``(N,)`` (``python -m crowdtrain_example_recipes.data digits.npz`` writes one).
A micro-batch reaches the model as ``x`` float32 ``(B, 1, 8, 8)`` and ``y`` int64 ``(B,)``.
"""

from __future__ import annotations

import torch
from torch import nn

from crowdtrain.volunteer.models import Arg, wrap


class SmallCNN(nn.Module):
    """Two convolution blocks (Conv2d, BatchNorm2d, ReLU, 2×2 max-pooling) and a linear classifier."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(channels),  # its running statistics are averaged across volunteers every step
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8×8 → 4×4
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4×4 → 2×2
        )
        self.head = nn.Linear(2 * channels * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))  # logits (B, classes)


RECIPE = wrap(
    "example-cnn",  # the entry point's name in pyproject.toml must be the same
    "arrays",
    SmallCNN,  # called as SmallCNN(channels=..., classes=...) with the run spec's args
    loss="cross_entropy",  # mean cross-entropy of the logits against y
    args={
        "channels": Arg(
            int, 16, "channels of the first convolution (twice as many in the second)", min=1, max=256
        ),
        "classes": Arg(int, 10, "number of classes; every label must be below it", min=2, max=10_000),
        # "seed" (the initial parameters' seed, default 0) is added by wrap
    },
    metrics="accuracy",
)
