"""How a plan synchronises gradients: exactly, or with a lossy choice the user allowed (``--allow-lossy``).

:class:`GradSync` is one field of the plan (``Plan.grad_sync``, JSON ``"grad_sync"``; a plan without it
syncs exactly). The kinds, each run with torch's own DDP communication hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) and model averagers:

* ``exact`` — the gradient all-reduce (sum of partial sums, or DDP's mean);
* ``bf16`` — every gradient bucket is cast to bf16 before its all-reduce and back after
  (``default_hooks.bf16_compress_hook``): 8 bits of mantissa instead of 24 in the summed gradient;
* ``powersgd`` — rank-``rank`` PowerSGD with error feedback (``powerSGD_hook.powerSGD_hook``): each matrix
  gradient ``M`` (n × m) is replaced by ``P·Qᵀ`` with ``P`` (n × r) and ``Q`` (m × r) all-reduced; 1-D
  gradients go uncompressed; exact all-reduce for the first ``warmup_steps`` steps;
* ``local-sgd`` — post-local SGD (``post_localSGD_hook`` + ``PeriodicModelAverager``): after
  ``warmup_steps`` exact steps each node's replicas average gradients among themselves only, and the
  parameters are averaged over every replica once every ``period`` steps.

:meth:`GradSync.parse` reads the command-line form (``exact``, ``bf16``, ``powersgd:4``,
``local-sgd:16``); :meth:`GradSync.describe` says what the choice changes numerically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from planner.errors import AutoplanError
from planner.plan.codec import JsonCoded

GradSyncKind = Literal["exact", "bf16", "powersgd", "local-sgd"]
GRAD_SYNC_KINDS: tuple[str, ...] = get_args(GradSyncKind)
DEFAULT_WARMUP_STEPS = 10  # exact steps before PowerSGD or local SGD start (torch needs at least 2 for PowerSGD)


class GradSyncError(AutoplanError):
    """A gradient-sync choice that is malformed or that a plan cannot run."""


@dataclass(frozen=True, kw_only=True)
class GradSync(JsonCoded):
    """How the plan synchronises gradients: exactly, or the lossy way the user allowed (the module docstring)."""

    kind: GradSyncKind = "exact"
    rank: int = 0  # powersgd: the matrix approximation rank r
    period: int = 0  # local-sgd: steps between two parameter averages H
    warmup_steps: int = 0  # powersgd, local-sgd: exact steps first (start_powerSGD_iter, start_localSGD_iter)

    def __post_init__(self) -> None:
        if self.kind not in GRAD_SYNC_KINDS:
            raise GradSyncError(f"unknown gradient sync {self.kind!r}: use one of {', '.join(GRAD_SYNC_KINDS)}")
        if (self.kind == "powersgd") != (self.rank > 0):
            raise GradSyncError(f"gradient sync {self.kind}: a PowerSGD rank (>= 1) goes with powersgd only")
        if (self.kind == "local-sgd") != (self.period > 0):
            raise GradSyncError(f"gradient sync {self.kind}: an averaging period (>= 1) goes with local-sgd only")
        if self.warmup_steps < 0 or (self.kind == "powersgd" and self.warmup_steps < 2):
            raise GradSyncError("PowerSGD needs at least 2 exact warm-up steps (torch's start_powerSGD_iter > 1)")

    @property
    def lossy(self) -> bool:
        return self.kind != "exact"

    @property
    def label(self) -> str:
        """The command-line form: ``exact``, ``bf16``, ``powersgd:4``, ``local-sgd:16``."""
        if self.kind == "powersgd":
            return f"powersgd:{self.rank}"
        if self.kind == "local-sgd":
            return f"local-sgd:{self.period}"
        return self.kind

    @classmethod
    def parse(cls, text: str) -> GradSync:
        """``exact`` | ``bf16`` | ``powersgd:R`` | ``local-sgd:H`` (warm-up: :data:`DEFAULT_WARMUP_STEPS`)."""
        kind, _, number = text.strip().partition(":")
        if kind in ("exact", "bf16") and not number:
            return cls(kind=kind)
        if kind in ("powersgd", "local-sgd") and number.isdigit() and int(number) > 0:
            value = int(number)
            if kind == "powersgd":
                return cls(kind=kind, rank=value, warmup_steps=DEFAULT_WARMUP_STEPS)
            return cls(kind=kind, period=value, warmup_steps=DEFAULT_WARMUP_STEPS)
        raise GradSyncError(
            f"--grad-sync {text!r}: use exact, bf16, powersgd:R or local-sgd:H (R, H positive integers)"
        )

    def describe(self) -> str:
        """What the choice changes in the numbers the optimizer sees, in one sentence."""
        if self.kind == "bf16":
            return "gradients are all-reduced in bf16 (cast before, back after: 8-bit mantissa sums)"
        if self.kind == "powersgd":
            return (
                f"matrix gradients are all-reduced as rank-{self.rank} PowerSGD factors P·Qᵀ with error feedback "
                f"(1-D gradients exact), after {self.warmup_steps} exact steps"
            )
        if self.kind == "local-sgd":
            return (
                f"after {self.warmup_steps} exact steps, gradients are averaged within each node only and the "
                f"parameters over every replica once every {self.period} steps (post-local SGD)"
            )
        return "gradients are synchronised exactly"
