"""Parity with one device: the same model, batch and optimizer in one process, compared by name.

:class:`Reference` (on rank 0) runs the user's own ``nn.Module`` — not our graph interpreter — on
the whole batch. :func:`gather_gradients` collects the whole gradient of every parameter from the
rank that reports it. :func:`compare` gives the largest difference of the loss and of every
gradient, and whether each is within ``|a − b| ≤ atol + rtol·|b|`` (fp32: rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executors.semantics import NoDropout, quiet_dropout_modules
from executors.session import split_batch

RTOL = 1e-4
ATOL = 1e-5


class Reference:
    """The single-process run: ``step()`` returns the loss and the gradients by name."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...], *, loss_data: tuple[Any, ...],
                 loss_fn: Callable[..., torch.Tensor],
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 batch_size: int, dropout: bool = True, chunks: int = 1) -> None:  # fmt: skip
        self.model, self.inputs, self.loss_data, self.loss_fn = model, inputs, loss_data, loss_fn
        self.dropout = dropout
        if not dropout:
            quiet_dropout_modules(model)
        self.batch_size = batch_size
        self.chunks = chunks  # the batch runs in this many equal chunks (the plan's batch statistics)
        self.optimizer = make_optimizer(list(model.parameters()))

    def step(self) -> tuple[float, dict[str, torch.Tensor]]:
        """Forward and backward; the caller compares, then calls :meth:`update`."""
        self.optimizer.zero_grad(set_to_none=True)
        batch = (*self.inputs, *self.loss_data)
        total = 0.0
        with contextlib.nullcontext() if self.dropout else NoDropout():
            for piece in split_batch(batch, num_chunks=self.chunks, batch_size=self.batch_size):
                inputs, data = piece[: len(self.inputs)], piece[len(self.inputs) :]
                loss = self.loss_fn(self.model(*inputs), data) / self.chunks
                loss.backward()
                total += float(loss.detach())
        grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None}
        return total, grads

    def update(self) -> None:
        self.optimizer.step()


def gather_gradients(local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every rank's reported gradients, merged on rank 0 (None elsewhere)."""
    payload = {name: grad.detach().cpu() for name, grad in local.items()}
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(payload, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


@dataclass(frozen=True, kw_only=True)
class ParityResult:
    loss_diff: float
    max_grad_diff: float
    worst: str  # the parameter with the largest gradient difference relative to its tolerance
    missing: tuple[str, ...]
    ok: bool

    def describe(self) -> str:
        verdict = "match" if self.ok else "MISMATCH"
        missing = f", {len(self.missing)} gradients missing (e.g. {self.missing[0]})" if self.missing else ""
        return (
            f"parity {verdict}: loss diff {self.loss_diff:.2e}, largest gradient diff {self.max_grad_diff:.2e} "
            f"({self.worst}){missing} [rtol {RTOL:g}, atol {ATOL:g}]"
        )


def compare(loss: float, reference_loss: float, grads: Mapping[str, torch.Tensor],
            reference: Mapping[str, torch.Tensor]) -> ParityResult:  # fmt: skip
    ok = abs(loss - reference_loss) <= ATOL + RTOL * abs(reference_loss)
    missing = tuple(name for name in reference if name not in grads)
    worst, worst_excess, max_diff = "-", -float("inf"), 0.0
    for name, expected in reference.items():
        if name not in grads:
            continue
        got = grads[name].to(expected.dtype).reshape(expected.shape)
        diff = (got - expected).abs()
        excess = float((diff - (ATOL + RTOL * expected.abs())).max())
        max_diff = max(max_diff, float(diff.max()))
        if excess > worst_excess:
            worst, worst_excess = name, excess
    ok = ok and not missing and worst_excess <= 0
    return ParityResult(loss_diff=abs(loss - reference_loss), max_grad_diff=max_diff, worst=worst, missing=missing,
                        ok=ok)  # fmt: skip
