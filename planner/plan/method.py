"""The methods a plan is made by (``--method``), by name: :class:`Method`.

A plan records the method that made it (:attr:`planner.plan.Plan.method`); the options
(:class:`planner.options.PlanOptions`) and the method registry (:data:`planner.methods.METHODS`) read the same enum.
"""

from __future__ import annotations

import enum


class Method(enum.StrEnum):
    """``--method``: auto's search, a hand-written plan, or an operator placement baseline."""

    AUTO = "auto"
    DATA_PARALLEL = "data-parallel"
    MEGATRON = "megatron"
    UNIFORM_PIPELINE = "uniform-pipeline"
    HASH = "hash"
    CRITICAL_PATH = "critical-path"
    MULTI_OBJECTIVE = "multi-objective"
    M_ETF = "m-etf"
    RL = "rl"
