"""What the plan's report reads of a plan (:class:`PlanView`), so the report, its shape line and its choices
(:mod:`planner.plan.report`, :mod:`~planner.plan.shape`, :mod:`~planner.plan.choices`) take a
:class:`planner.plan.value.Plan` without importing it, and the plan can print its own summary
(:meth:`~planner.plan.value.Plan.summary`, ``print(plan)``) without an import cycle.
"""

from __future__ import annotations

from typing import Protocol

from cost_models.cluster import Cluster
from planner.plan.grad_sync import GradSync
from planner.plan.megatron_terms import MegatronTerms
from planner.plan.method import Method
from planner.plan.parts import Estimate, ModelRef, SearchStats
from planner.plan.schedules import Schedule
from planner.plan.stage import Stage


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
