"""Which gradient sync a candidate runs (exact, or a lossy choice the user allowed), and what its step costs.

A candidate's step (:func:`planner.inter.pricing.price_stages`) is ``T = Σ t_s + (m − 1)·P + U + w + o`` with
``U = max_s (u_s − Σ_{k<s} drains[k])`` (:func:`planner.inter.pricing._sync_after_s`), where stage ``s``'s
step work after its last backward is, under a gradient sync ``g``,

    u_s(g) = step_s − a_s + A_s(g),   A_s(g) = after_backward(segments_s(g), b_s) + amortised_s(g)

* ``step_s``: the stage problem's gradient sync and optimizer update, ``a_s`` the additive sync shares in it
  (:func:`stage_backward`: ``Σ NodeWork.grad_sync_s``), replaced by the buckets;
* ``segments_s(g)``: the stage's buckets in its last backward, priced under ``g``
  (:func:`planner.costing.compression.stage_sync`), ``b_s`` that backward (recomputation and half the host
  overhead included), ``after_backward`` what the step waits past it
  (:func:`planner.costing.overlap.after_backward_s`; a zero-bubble stage sends its buckets after its last
  weight-gradient pass: no overlap, :func:`after_s`);
* ``amortised_s(g)``: local SGD's parameter average, once every ``H`` steps.

A one-stage DDP plan is ``m·compute + rest + A(g) + o`` (:func:`planner.costing.ddp.ddp_step`). The
choices (:func:`offered`): ``exact``; with ``allow_lossy`` also :data:`LOSSY_CHOICES` where the plan can run
them (:func:`planner.costing.compression.refusal`); a forced one (``--grad-sync``) alone — any kind, the gathered
ones (topk, onebit, threshold, terngrad, qsgd, signsgd) included. The error-feedback buffers (PowerSGD's, and the
fp32 residuals of topk, onebit and threshold) must still fit in memory. :func:`choose_grad_sync` keeps the
fastest (exact on a tie); ``grad_sync_saved_s`` = ``T(exact) − T(chosen)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from planner.costing.compression import EXACT, stage_sync
from planner.costing.overlap import after_backward_s
from planner.costing.setup import CostSetup
from planner.costing.stage_work import stage_node_work
from planner.costing.sync.gathered import compute_source, pricing_caveat
from planner.ir.graph import OpGraph
from planner.plan import GradSync, Stage
from planner.plan.grad_sync import DEFAULT_WARMUP_STEPS

PS_SERVERS = (2, 4, 8, 16, 32, 64)  # the server counts auto prices (refused above the replicas)
# What auto may choose: exactly the choices tests/test_lossy_sync.py trains within its tolerance of exact sync, and
# the synchronous parameter servers (the same update as exact sync).
# PowerSGD of rank 1 did not (on its 32-wide MLP the loss lagged by up to 17% of the first loss) and rank 16 leaves
# that MLP's matrices uncompressed (nothing to test): both run only when forced (--grad-sync).
LOSSY_CHOICES = (
    GradSync(kind="bf16"),
    GradSync(kind="powersgd", rank=4, warmup_steps=DEFAULT_WARMUP_STEPS),
    *(GradSync(kind="local-sgd", period=period, warmup_steps=DEFAULT_WARMUP_STEPS) for period in (4, 16)),
    # the gathered syncs that trained within the tolerance on every model of tests/test_lossy_sync.py
    GradSync(kind="terngrad", warmup_steps=DEFAULT_WARMUP_STEPS),
    GradSync(kind="qsgd", levels=16, warmup_steps=DEFAULT_WARMUP_STEPS),
    GradSync(kind="signsgd", warmup_steps=DEFAULT_WARMUP_STEPS),
    # synchronous parameter servers: exact sync's update (tests/test_parameter_server.py checks it by parity); the
    # stale ones missed the tolerance (tests/test_lossy_sync.py's docstring) and run only when forced
    *(GradSync(kind="ps", servers=servers) for servers in PS_SERVERS),
)


def offered(*, allow_lossy: bool, forced: GradSync | None) -> tuple[GradSync, ...]:
    """The gradient syncs a candidate is priced with: the forced one, or exact (and the lossy ones if allowed)."""
    if forced is not None:
        return (forced,)
    return (EXACT, *LOSSY_CHOICES) if allow_lossy else (EXACT,)


@dataclass(frozen=True, kw_only=True)
class StageBackward:
    """What a stage's sync pricing reads of its work: every node's backward seconds and the additive shares."""

    node_bwd_s: Mapping[str, float]
    additive_s: float


def stage_backward(stage: Stage, graph: OpGraph, setup: CostSetup, *, zero: bool = False) -> StageBackward:
    work = stage_node_work(stage, graph, setup, zero=zero)
    return StageBackward(
        node_bwd_s={name: w.bwd_s for name, w in work.items()},
        additive_s=math.fsum(w.grad_sync_s for w in work.values()),
    )


def after_s(
    stage: Stage,
    graph: OpGraph,
    backward: StageBackward,
    setup: CostSetup,
    *,
    grad_sync: GradSync,
    last_backward_s: float,
    overlapped: bool = True,
) -> tuple[float, float]:
    """(``A_s(g)``: seconds the stage's step waits past its last backward for its gradient sync, per-device bytes
    the choice adds) for ``stage`` (its nodes in ``graph``)."""
    sync = stage_sync(stage, graph, backward.node_bwd_s, setup, grad_sync=grad_sync, ddp=False)
    if not sync.segments:
        return 0.0, 0.0
    if overlapped:
        waited = after_backward_s(sync.segments, backward_s=last_backward_s)
    else:
        waited = math.fsum(segment.all_reduce_s + segment.compress_s for segment in sync.segments)
    return waited + sync.amortised_s, sync.state_bytes


@dataclass(frozen=True, kw_only=True)
class SyncChoice:
    grad_sync: GradSync
    step_s: float
    state_bytes: float  # added per device (error feedback: PowerSGD's, the gathered kinds' residuals)
    exact_step_s: float | None  # the same candidate under exact sync (None: not offered)

    @property
    def saved_s(self) -> float:
        return 0.0 if self.exact_step_s is None else self.exact_step_s - self.step_s

    def note(self, setup: CostSetup | None = None) -> str:
        """What the chosen sync changed and what it saved, for the plan's notes (with ``setup``: how its compute was
        priced, :func:`planner.costing.sync.gathered.compute_source`)."""
        text = f"gradient sync {self.grad_sync.label}: {self.grad_sync.describe()}"
        caveats = (pricing_caveat(self.grad_sync), compute_source(self.grad_sync, setup) if setup else None)
        for caveat in caveats:
            if caveat:
                text = f"{text}; {caveat}"
        if self.exact_step_s is None:
            return text
        compared = "less" if self.saved_s >= 0 else "more"  # forced: exact sync may have had a faster layout
        return (
            f"{text}; estimated step {self.step_s:.4g} s, {abs(self.saved_s):.3g} s {compared} than exact sync "
            f"({self.exact_step_s:.4g} s)"
        )


def choose_grad_sync(
    choices: Sequence[GradSync],
    *,
    price: Callable[[GradSync], tuple[float, float] | None],
    memory_bytes: float,
    budget_bytes: float,
) -> SyncChoice | None:
    """The fastest of ``choices`` (``price(g)``: (step s, bytes added per device), None where the plan cannot run
    ``g``) that fits; exact on a tie. None when none can run. Exact sync is priced too, to say what a lossy
    choice saved."""
    priced: list[tuple[GradSync, float, float]] = []
    for grad_sync in choices:
        result = price(grad_sync)
        assert result is None or result[0] > 0, f"internal error (please report): {grad_sync.label} step {result}"
        if result is not None and memory_bytes + result[1] <= budget_bytes:
            priced.append((grad_sync, *result))
    if not priced:
        return None
    best = min(priced, key=lambda row: (row[1], row[0].lossy))
    exact = next((step for grad_sync, step, _ in priced if not grad_sync.lossy), None)
    if exact is None and best[0].lossy:
        baseline = price(EXACT)
        exact = None if baseline is None else baseline[0]
    return SyncChoice(grad_sync=best[0], step_s=best[1], state_bytes=best[2], exact_step_s=exact)
