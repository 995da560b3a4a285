"""A stack of mixture-of-experts MLP blocks (no attention).

Each block normalizes its input, routes every token to its ``top_k`` best
experts (softmax router, renormalized top-k gates) and adds the gated expert
outputs to the residual stream.  The experts are stored as batched parameters
``w1`` [experts, hidden, ffn] and ``w2`` [experts, ffn, hidden] and evaluated
densely: every expert processes every token and the combine weights (zero for
unselected experts) pick the result.  This wastes FLOPs but keeps all shapes
static, so the model traces cleanly.  A final ``head`` Linear follows the
blocks.

Keyword arguments (for both ``build_model`` and ``example_inputs``):

- ``hidden``: model width (default 256).
- ``experts``: experts per block (default 4).
- ``top_k``: experts chosen per token (default 2).
- ``layers``: number of MoE blocks (default 2).
- ``ffn``: inner width of each expert (default ``4 * hidden``).
- ``tokens``: sequence length of the inputs (default 64).

Inputs are ``x`` [batch, tokens, hidden]. Parameter names look like
``blocks.0.norm.weight``, ``blocks.0.router.weight``, ``blocks.0.w1``,
``blocks.0.w2``, ``head.weight``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MoEBlock(nn.Module):
    """LayerNorm -> top-k routed experts (dense formulation) -> residual add."""

    def __init__(self, hidden: int, experts: int, top_k: int, ffn: int) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
        self.top_k = top_k
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.w1.shape[1] ** -0.5)
        nn.init.normal_(self.w2, std=self.w2.shape[1] ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x).flatten(0, -2)  # [N, D]
        probs = F.softmax(self.router(h), dim=-1)  # [N, E]
        vals, idx = torch.topk(probs, self.top_k, dim=-1)
        vals = vals / vals.sum(dim=-1, keepdim=True)
        combine = torch.zeros_like(probs).scatter(-1, idx, vals)  # [N, E]
        inner = F.gelu(torch.einsum("nd,edf->enf", h, self.w1))
        y = torch.einsum("enf,efd->end", inner, self.w2)
        out = torch.einsum("end,ne->nd", y, combine)
        return x + out.view_as(x)


class MoE(nn.Module):
    """``layers`` MoE blocks followed by a linear ``head``."""

    def __init__(self, hidden: int, experts: int, top_k: int, layers: int, ffn: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(hidden, experts, top_k, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(
    *,
    hidden: int = 256,
    experts: int = 4,
    top_k: int = 2,
    layers: int = 2,
    ffn: int | None = None,
    **_: object,
) -> nn.Module:
    """Build the MoE stack described in the module docstring."""
    hidden = int(hidden)
    inner = int(ffn) if ffn is not None else 4 * hidden
    return MoE(hidden, int(experts), int(top_k), int(layers), inner)


def example_inputs(batch_size: int, *, hidden: int = 256, tokens: int = 64, **_: object) -> tuple[Tensor, ...]:
    """One training step's inputs: ``(x,)`` of shape [batch_size, tokens, hidden]."""
    return (torch.randn(batch_size, int(tokens), int(hidden)),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Mean squared output."""
    return output.pow(2).mean()
