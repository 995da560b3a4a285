"""The plan: a frozen value with a JSON round-trip that holds everything the executors need.

* :mod:`~planner.plan.value` — ``Plan``, ``ModelRef``, ``Estimate``, ``SearchStats``, saving and loading;
* :mod:`~planner.plan.stage` — ``Stage`` and every node's chosen strategy (``NodeSharding``, ``Collective``);
* :mod:`~planner.plan.validate` — ``validate_plan``: a plan checked against its graph;
* :mod:`~planner.plan.explain` — ``ExplainRow``, the per-node explanation a stage stores;
* :mod:`~planner.plan.report` — the plain-text summary ``plan`` prints.

May import: :mod:`planner.ir`, :mod:`planner.errors`, :mod:`cost_models` (the cluster, atomic files).
:mod:`executors` read plans through this package and nothing of the search.
"""

from planner.plan.explain import ExplainRow
from planner.plan.stage import COLLECTIVE_KINDS, PHASES, Collective, NodeSharding, Stage
from planner.plan.validate import parse_placement, validate_plan
from planner.plan.value import (
    FORMAT_VERSION,
    SCHEDULES,
    Estimate,
    ModelRef,
    Plan,
    PlanError,
    SearchStats,
    load_plan,
    save_plan,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "FORMAT_VERSION",
    "PHASES",
    "SCHEDULES",
    "Collective",
    "Estimate",
    "ExplainRow",
    "ModelRef",
    "NodeSharding",
    "Plan",
    "PlanError",
    "SearchStats",
    "Stage",
    "load_plan",
    "parse_placement",
    "save_plan",
    "validate_plan",
]
