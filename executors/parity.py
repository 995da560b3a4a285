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

from executors.precision import Precision
from executors.semantics import NoDropout, quiet_dropout_modules
from executors.session import split_batch

RTOL = 1e-4  # fp32; bf16 runs use Precision.rtol / Precision.atol
ATOL = 1e-5


class Reference:
    """The single-process run: ``step(batch)`` returns the loss, the gradients by name and their norm
    (after clipping to ``max_grad_norm`` when given, as the parallel run clips)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_inputs: int,
        loss_data: Callable[[tuple[Any, ...]], tuple[Any, ...]],
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
        batch_size: int,
        precision: Precision,
        dropout: bool = True,
        chunks: int = 1,
        max_grad_norm: float | None = None,
        scheduler: Any = None,
    ) -> None:
        self.model, self.num_inputs, self.loss_data, self.loss_fn = model, num_inputs, loss_data, loss_fn
        self.dropout, self.precision, self.max_grad_norm = dropout, precision, max_grad_norm
        if not dropout:
            quiet_dropout_modules(model)
        self.batch_size = batch_size
        self.chunks = chunks  # the batch runs in this many equal chunks (the plan's batch statistics)
        self.optimizer, self.scheduler = optimizer, scheduler

    def step(self, batch: tuple[Any, ...]) -> tuple[float, dict[str, torch.Tensor], float]:
        """Forward and backward of the whole batch; the caller compares, then calls :meth:`update`."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        first = next(self.model.parameters(), None)
        device = first.device.type if first is not None else "cpu"
        with contextlib.nullcontext() if self.dropout else NoDropout():
            for piece in split_batch(batch, num_chunks=self.chunks, batch_size=self.batch_size):
                with self.precision.autocast(device):
                    loss = self.loss_fn(self.model(*piece[: self.num_inputs]), self.loss_data(piece)) / self.chunks
                loss.backward()
                total += float(loss.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        # float64, as the parallel run sums it (torch's fp32 norm of a 4096-element gradient is off by ~1e-5)
        norm = float(torch.stack([p.grad.double().norm() for p in params]).norm()) if params else 0.0
        if self.max_grad_norm is not None and params:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, torch.tensor(norm))
        # on the CPU, where gather_gradients puts the parallel run's
        grads = {
            name: p.grad.detach().to("cpu", copy=True)
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }
        return total, grads, norm

    def update(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()


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
    rtol: float = RTOL
    atol: float = ATOL
    grad_norm_diff: float = 0.0
    hint: str = ""  # the likely cause of a mismatch, when the figures point at one (:func:`likely_cause`)

    def describe(self) -> str:
        verdict = "match" if self.ok else "MISMATCH"
        missing = f", {len(self.missing)} gradients missing (e.g. {self.missing[0]})" if self.missing else ""
        hint = f"; likely cause: {self.hint}" if self.hint else ""
        return (
            f"parity {verdict}: loss diff {self.loss_diff:.2e}, largest gradient diff {self.max_grad_diff:.2e} "
            f"({self.worst}){missing}, gradient norm diff {self.grad_norm_diff:.2e} "
            f"[rtol {self.rtol:g}, atol {self.atol:g}]{hint}"
        )


def likely_cause(loss: float, reference_loss: float) -> str:
    """A loss ``k`` times the other's (``k`` a whole number ≥ 2) is a loss that sums over the batch's rows: the
    parallel run averages its microbatches' and replicas' losses, which equals one device's only for a mean."""
    if loss == 0 or reference_loss == 0 or (loss > 0) != (reference_loss > 0):
        return ""
    ratio = max(loss / reference_loss, reference_loss / loss)
    if round(ratio) >= 2 and abs(ratio - round(ratio)) <= 1e-3 * ratio:
        return (
            f"the loss is {round(ratio)}x the other run's: a loss summed over the batch's rows (reduction=\"sum\"); "
            "the parallel run averages its microbatches' and replicas' losses, so the loss must be a batch mean"
        )
    return ""


def compare(
    loss: float,
    reference_loss: float,
    grads: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    norms: tuple[float, float] | None = None,
) -> ParityResult:
    """Loss, every gradient and (when given) the gradient norms ``(ours, reference)`` within
    ``|a − b| ≤ atol + rtol·|b|``."""
    ok = abs(loss - reference_loss) <= atol + rtol * abs(reference_loss)
    norm_diff = abs(norms[0] - norms[1]) if norms else 0.0
    ok = ok and (norms is None or norm_diff <= atol + rtol * abs(norms[1]))
    missing = tuple(name for name in reference if name not in grads)
    worst, worst_excess, max_diff = "-", -float("inf"), 0.0
    for name, expected in reference.items():
        if name not in grads:
            continue
        got = grads[name].to(expected.dtype).reshape(expected.shape)
        diff = (got - expected).abs()
        excess = float((diff - (atol + rtol * expected.abs())).max())
        max_diff = max(max_diff, float(diff.max()))
        if excess > worst_excess:
            worst, worst_excess = name, excess
    ok = ok and not missing and worst_excess <= 0
    return ParityResult(
        loss_diff=abs(loss - reference_loss),
        max_grad_diff=max_diff,
        worst=worst,
        missing=missing,
        ok=ok,
        rtol=rtol,
        atol=atol,
        grad_norm_diff=norm_diff,
        hint="" if ok else likely_cause(loss, reference_loss),
    )
