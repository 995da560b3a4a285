"""What a run trains with: the optimizer and numeric precision the plan was costed with, or a stated deviation.

A plan names its optimizer (``Plan.optimizer``), and the cost model charges memory by it
(``cost_models/memory.py``):

* ``adam-mixed`` — 16 B/param: bf16 compute, fp32 master weights and Adam state. It runs as
  :class:`Precision` ``bf16``: fp32 parameters (the master weights), fp32 gradients and Adam state,
  and every forward under ``torch.autocast(dtype=torch.bfloat16)`` (matmuls and convolutions in bf16,
  reductions and norms in fp32). Floating values that cross a stage or device boundary travel in bf16
  (:meth:`Precision.wire_dtype`), as the estimate's boundary bytes assume on a mixed-precision device.
* ``adam-fp32``, ``sgd``, ``sgd-momentum`` — everything fp32.

:func:`make_optimizer` builds the torch optimizer for a name (AdamW for both Adams, SGD with or
without momentum 0.9). :func:`deviation` says, in one line, how the estimate stops applying when a
run overrides the plan's optimizer (``--optimizer sgd`` on an ``adam-mixed`` plan).

Parity under bf16 compares against the same precision in one process, so tolerances follow the
precision (:attr:`Precision.rtol`, :attr:`Precision.atol`): bf16 keeps 8 bits of mantissa (relative
rounding 2^-9 ≈ 2e-3 per operation), and a different matmul split or reduction order changes the
rounding of every product, so the bf16 tolerance is loose (rtol 3e-2, atol 1e-3) while fp32 stays
at rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from cost_models.memory import OPTIMIZERS, optimizer_bytes
from planner.errors import AutoplanError
from planner.plan import GradSync

RUN_OPTIMIZERS = tuple(OPTIMIZERS)  # adam-mixed, adam-fp32, sgd, sgd-momentum
MIXED = "adam-mixed"
SGD_MOMENTUM = 0.9  # sgd-momentum's momentum (executors.compressed_sync.DGC_MOMENTUM moves it into the sync)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """The numeric precision of a run: ``bf16`` (autocast, fp32 master weights) or ``fp32``."""

    name: str

    @staticmethod
    def for_optimizer(optimizer: str) -> Precision:
        return Precision(name="bf16" if optimizer == MIXED else "fp32")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.name == "bf16" else None

    @property
    def rtol(self) -> float:
        return 3e-2 if self.name == "bf16" else 1e-4

    @property
    def atol(self) -> float:
        return 1e-3 if self.name == "bf16" else 1e-5

    @contextlib.contextmanager
    def autocast(self, device: str) -> Iterator[None]:
        """Forward (and the loss) under bf16 autocast, or nothing for fp32."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device.split(":")[0], dtype=self.autocast_dtype):
            yield

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a value of ``dtype`` takes across a stage or device boundary."""
        if self.autocast_dtype is not None and dtype.is_floating_point:
            return self.autocast_dtype
        return dtype

    def describe(self) -> str:
        if self.name == "bf16":
            return "bf16 autocast, fp32 master weights, gradients and optimizer state"
        return "fp32"


def check_optimizer(name: str) -> None:
    if name not in RUN_OPTIMIZERS:
        raise AutoplanError(f"--optimizer must be one of {', '.join(RUN_OPTIMIZERS)}, got {name!r}")


def make_optimizer(
    name: str,
    params: list[nn.Parameter],
    *,
    lr: float,
    weight_decay: float = 0.0,
    grad_sync: GradSync | None = None,
) -> torch.optim.Optimizer:
    """The torch optimizer a plan's optimizer name stands for (fp32 state in every case). Under Deep Gradient
    Compression (``grad_sync`` dgc) the momentum of ``sgd-momentum`` lives in the gradient sync
    (:class:`executors.compressed_sync.DgcGradient`: momentum correction), so the SGD here runs without it."""
    check_optimizer(name)
    if grad_sync is not None and grad_sync.kind == "dgc" and name != "sgd-momentum":
        raise AutoplanError(f"--grad-sync {grad_sync.label} keeps SGD's momentum in the sync: run it with sgd-momentum")
    if not params:  # a rank that holds no parameter (an idle device of a placement) steps nothing
        params = [nn.Parameter(torch.empty(0))]
    if name.startswith("adam"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
    momentum = SGD_MOMENTUM if name == "sgd-momentum" else 0.0
    if grad_sync is not None and grad_sync.kind == "dgc":
        momentum = 0.0
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def describe_optimizer(name: str) -> str:
    """E.g. ``AdamW, 16 B/param, bf16 autocast, fp32 master weights, gradients and optimizer state``."""
    kind = "AdamW" if name.startswith("adam") else "SGD" + (" with momentum" if name == "sgd-momentum" else "")
    return f"{kind}, {optimizer_bytes(name).total} B/param, {Precision.for_optimizer(name).describe()}"


def deviation(*, planned: str, running: str) -> str | None:
    """One line saying how the estimate no longer applies, or None when the run is what was planned."""
    if planned == running:
        return None
    return (
        f"note: the plan was costed with {planned} ({describe_optimizer(planned)}); this run uses {running} "
        f"({describe_optimizer(running)}), so its memory and step time no longer match the estimate"
    )
