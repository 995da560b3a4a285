"""The plan's parts that are values of their own: what it is expected to cost (:class:`Estimate`, with what its choices
saved, :class:`PlanSavings`), where its search spent its time (:class:`SearchStats`) and the model it was made for
(:class:`ModelRef`); and what the plan's report reads of a plan (:class:`PlanView`), so the report, its shape line and
its choices (:mod:`planner.plan.report`, :mod:`~planner.plan.shape`, :mod:`~planner.plan.choices`) take a
:class:`planner.plan.value.Plan` without importing it, and the plan prints its own summary
(:meth:`~planner.plan.value.Plan.summary`, ``print(plan)``) without an import cycle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from cost_models.cluster import Cluster
from planner.plan.codec import JsonCoded
from planner.plan.grad_sync import GradSync
from planner.plan.megatron_terms import MegatronTerms
from planner.plan.method import Method
from planner.plan.schedules import Schedule
from planner.plan.stage import Stage

BREAKDOWN_TOLERANCE = 1e-9  # relative: float rounding between a step and the sum of its parts


@dataclass(frozen=True, kw_only=True)
class PlanSavings(JsonCoded):
    """What the whole plan's choices saved against the option each replaced, per step and per device (None: that
    choice was not made): the schedule against the GPipe or 1F1B pipeline it was cut from
    (:mod:`planner.inter.schedule_variants`), a lossy gradient sync against exact (:mod:`planner.plan.choices`)."""

    schedule_saved_s: float | None = None
    schedule_saved_bytes: float | None = None
    grad_sync_saved_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Estimate(JsonCoded):
    """What a plan is expected to cost per step.

    ``breakdown_s``: the parts of the step, each non-negative, adding up to ``step_time_s`` (:meth:`breakdown_error`
    says where they do not). ``hidden_s``: work that runs behind the step's parts and is not added to them (the
    gradient all-reduce the backward pass hides). ``savings``: what the plan's choices saved (:class:`PlanSavings`).
    """

    step_time_s: float
    per_stage_time_s: tuple[float, ...]
    memory_per_device_bytes: int
    bubble_fraction: float
    tflops_per_device: float
    mfu: float = 0.0
    breakdown_s: Mapping[str, float] = field(default_factory=dict)
    hidden_s: Mapping[str, float] = field(default_factory=dict)
    savings: PlanSavings = field(default_factory=PlanSavings)

    def breakdown_error(self) -> str | None:
        """Why the breakdown is not the step cut into non-negative parts; None when it is."""
        negative = {key: value for key, value in self.breakdown_s.items() if value < 0}
        if negative:
            return f"negative parts {negative}"
        total = math.fsum(self.breakdown_s.values())
        if not math.isclose(total, self.step_time_s, rel_tol=BREAKDOWN_TOLERANCE, abs_tol=1e-15):
            return f"parts add up to {total!r} s, the step is {self.step_time_s!r} s"
        return None


@dataclass(frozen=True, kw_only=True)
class SearchStats(JsonCoded):
    """Where the search spent its time (seconds) and how many layer problems it solved."""

    time_s: float
    capture_s: float = 0.0
    cost_s: float = 0.0
    ilp_solves: int = 0
    ilp_s: float = 0.0  # building and solving the intra-op problems of layers
    dp_s: float = 0.0  # the stage DP and the hand-written grid
    price_s: float = 0.0  # re-pricing candidates on whole stages


@dataclass(frozen=True, kw_only=True)
class ModelRef(JsonCoded):
    """Where the model came from, so executors can rebuild and check it."""

    fingerprint: str
    num_params: int
    file: str | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    tracer: str = "export"
    # the second dim of the first input when it is batch × sequence integer token ids; None: not tokens
    sequence_length: int | None = None


class PlanView(Protocol):
    """The fields and derived figures of a plan that its report reads (all read-only)."""

    @property
    def method(self) -> Method: ...

    @property
    def model(self) -> ModelRef: ...

    @property
    def cluster(self) -> Cluster: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def num_microbatches(self) -> int: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def optimizer(self) -> str: ...

    @property
    def stages(self) -> tuple[Stage, ...]: ...

    @property
    def estimate(self) -> Estimate: ...

    @property
    def search(self) -> SearchStats: ...

    @property
    def notes(self) -> tuple[str, ...]: ...

    @property
    def memory_fraction(self) -> float: ...

    @property
    def grad_sync(self) -> GradSync: ...

    @property
    def zero(self) -> int: ...

    @property
    def virtual_stages(self) -> int: ...

    @property
    def memory_budget_bytes(self) -> float: ...

    @property
    def megatron(self) -> MegatronTerms: ...
