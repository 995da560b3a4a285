"""A residual MLP stack (Megatron-style column/row blocks).

The model is ``layers`` residual blocks, each ``Linear(d, hidden) -> GELU ->
Linear(hidden, d)`` plus a skip connection, where ``d = in_features``.  In a
tensor-parallel plan ``fc1`` is the column-parallel and ``fc2`` the
row-parallel half of the Megatron MLP pattern.

Keyword arguments (for both ``build_model`` and ``example_inputs``):

- ``hidden``: width of the inner layer of each block (default 1024).
- ``layers``: number of residual blocks (default 4).
- ``in_features``: width of the input and of the residual stream
  (default: ``hidden``).
- ``out_features``: width of the output (default: ``in_features``); when it
  differs from ``in_features`` a final ``head`` Linear projects to it.

Module paths look like ``blocks.0.fc1``, ``blocks.0.fc2``, ``head``.
"""

import torch
from torch import Tensor, nn


class Block(nn.Module):
    """One residual MLP block: ``x + fc2(gelu(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class MLP(nn.Module):
    """A stack of residual MLP blocks with an optional output projection."""

    def __init__(self, in_features: int, hidden: int, layers: int, out_features: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(in_features, hidden) for _ in range(layers)))
        self.head: nn.Module = nn.Identity() if out_features == in_features else nn.Linear(in_features, out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))


def build_model(
    *,
    hidden: int = 1024,
    layers: int = 4,
    in_features: int | None = None,
    out_features: int | None = None,
    **_: object,
) -> nn.Module:
    """Build the residual MLP stack described in the module docstring."""
    d_in = int(in_features) if in_features is not None else int(hidden)
    d_out = int(out_features) if out_features is not None else d_in
    return MLP(d_in, int(hidden), int(layers), d_out)


def example_inputs(
    batch_size: int,
    *,
    hidden: int = 1024,
    in_features: int | None = None,
    **_: object,
) -> tuple[Tensor, ...]:
    """One training step's inputs: ``(x,)`` with ``x`` of shape [batch_size, in_features]."""
    d_in = int(in_features) if in_features is not None else int(hidden)
    return (torch.randn(batch_size, d_in),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Mean squared output."""
    return output.pow(2).mean()
