"""The probe model ``plan calibrate`` runs to fit the executors' host overheads.

A stack of residual blocks ``x + fc2(gelu(fc1(x)))`` of width ``width`` (default 16): narrow enough
that the arithmetic is negligible and a step measures what the runtime costs around each operator,
collective and microbatch. Keyword arguments: ``width``, ``layers``, ``activations`` (GELUs in a row
inside each block: more operators per collective).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _Block(nn.Module):
    def __init__(self, width: int, activations: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.acts = nn.Sequential(*(nn.GELU() for _ in range(activations)))
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.acts(self.fc1(x)))


def build_model(*, width: int = 16, layers: int = 4, activations: int = 1, **_: object) -> nn.Module:
    return nn.Sequential(*(_Block(int(width), int(activations)) for _ in range(int(layers))))


def example_inputs(batch_size: int, *, width: int = 16, **_: object) -> tuple[Tensor]:
    return (torch.randn(batch_size, int(width)),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Mean squared output."""
    return output.pow(2).mean()
