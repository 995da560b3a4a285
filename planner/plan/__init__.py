"""The plan: a frozen value with a JSON round-trip that holds everything the executors need.

* :mod:`~planner.plan.value` — ``Plan`` (``plan.summary()``, ``print(plan)``), saving and loading;
* :mod:`~planner.plan.parts` — ``ModelRef``, ``Estimate`` (its ``PlanSavings``), ``SearchStats``, and ``PlanView``:
  what the report reads of a plan;
* :mod:`~planner.plan.codec` — the generic dataclass ⇄ JSON codec and JSON Schema every class of the plan is written by;
* :mod:`~planner.plan.schema` — the plan's JSON Schema (``python -m planner.plan.schema``: ``docs/plan-schema.json``);
* :mod:`~planner.plan.grad_sync` — ``GradSync``: exact, or the lossy gradient sync the user allowed;
* :mod:`~planner.plan.stage` — ``Stage``, every node's chosen strategy (``NodeSharding``, ``Collective``) and what
  the stage's choices saved (``Saving``, ``MemorySaving``);
* :mod:`~planner.plan.validate` — ``validate_plan``: a plan checked against its graph;
* :mod:`~planner.plan.explain` — ``ExplainRow``, the per-node explanation a stage stores;
* :mod:`~planner.plan.megatron_terms` — ``MegatronTerms``: the plan in Megatron-LM's terms (the JSON's read-only
  ``megatron`` block, ``Plan.megatron``);
* :mod:`~planner.plan.report` — the plain-text summary ``plan`` prints (``planner.api.summary(plan)``);
* :mod:`~planner.plan.choices` — which choices each stage uses and what each saved (``--explain``, ``plan show``).

May import: :mod:`planner.ir`, :mod:`planner.errors`, :mod:`cost_models` (the cluster, atomic files).
:mod:`executors` read plans through this package and nothing of the search.
"""

from planner.plan.explain import ExplainRow
from planner.plan.grad_sync import GRAD_SYNC_KINDS, GradSync, GradSyncError
from planner.plan.method import Method
from planner.plan.parts import Estimate, ModelRef, PlanSavings, SearchStats
from planner.plan.schedules import Schedule
from planner.plan.stage import (
    COLLECTIVE_KINDS,
    GATHERED,
    PHASES,
    ZERO_LEVELS,
    Collective,
    MemorySaving,
    NodeSharding,
    Remat,
    Saving,
    Stage,
)
from planner.plan.validate import parse_placement, validate_plan
from planner.plan.value import FORMAT_VERSION, SCHEDULES, Plan, PlanError, load_plan, save_plan

__all__ = [
    "COLLECTIVE_KINDS",
    "FORMAT_VERSION",
    "GATHERED",
    "GRAD_SYNC_KINDS",
    "PHASES",
    "SCHEDULES",
    "ZERO_LEVELS",
    "Collective",
    "Estimate",
    "ExplainRow",
    "GradSync",
    "GradSyncError",
    "MemorySaving",
    "Method",
    "ModelRef",
    "NodeSharding",
    "Plan",
    "PlanError",
    "PlanSavings",
    "Remat",
    "Saving",
    "Schedule",
    "SearchStats",
    "Stage",
    "load_plan",
    "parse_placement",
    "save_plan",
    "validate_plan",
]
