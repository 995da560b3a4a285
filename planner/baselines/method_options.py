"""Which planner options each method honours, and the one-line refusal of the others.

Every method plans with every option it is given or refuses it before any work (:func:`check_method_options`):

* ``--degrees T,P,D`` is Megatron's configuration: ``megatron`` evaluates it, ``auto`` holds it as its Megatron
  candidate; the other methods refuse it.
* ``--zero 2`` and ``--zero 3`` shard gradients (and parameters) under FSDP, which runs on data-parallel plans
  only (:mod:`planner.costing.zero`): ``megatron`` and ``uniform-pipeline`` refuse them (their stages shard the
  optimizer state at most, ``--zero 1``); ``auto`` then keeps only data-parallel plans.
* ``--schedule`` orders a pipeline's microbatches: ``data-parallel`` plans have one stage and refuse it.
* the operator placements (``hash``, ``critical-path``, ...) run every operator whole on one device under the
  dataflow schedule, with neither recomputation nor sharded state: they refuse recomputation, a ZeRO level and
  ``--schedule``.
"""

from __future__ import annotations

import math

from cost_models.memory import model_state_bytes
from cost_models.units import GIB
from planner.costing.setup import CostSetup
from planner.errors import AutoplanError
from planner.options import (
    PLACEMENT_METHODS,
    Method,
    OffloadChoice,
    PlanOptions,
    RematChoice,
    ScheduleChoice,
    ZeroChoice,
)

SHARDED_STATE_METHODS = (Method.MEGATRON, Method.UNIFORM_PIPELINE)
NO_RECOMPUTATION = (RematChoice.AUTO, RematChoice.OFF, RematChoice.OFF_OR_FULL)  # what a placement can honour


def method_option_refusal(method: Method | str, options: PlanOptions) -> str | None:
    """Why ``method`` cannot plan with ``options``, in one line; None when it honours them all."""
    if options.degrees is not None and method not in (Method.MEGATRON, Method.AUTO):
        return (
            f"--degrees sets Megatron's (tensor, pipeline, data) degrees: use it with --method megatron, not {method}"
        )
    zero = options.zero
    if options.offload == OffloadChoice.ON and method not in (Method.AUTO, Method.DATA_PARALLEL):
        return (
            f"--offload on moves FSDP's shards to the CPU, which runs on data-parallel plans only: use --method "
            f"data-parallel or auto, not {method}"
        )
    if method in SHARDED_STATE_METHODS and zero in (ZeroChoice.GRADIENTS, ZeroChoice.PARAMETERS):
        sharded = "gradients and parameters" if zero == ZeroChoice.PARAMETERS else "gradients"
        return (
            f"--zero {zero} shards {sharded} under FSDP, which runs on "
            f"data-parallel plans only; {method} stages shard the optimizer state at most: use --zero 1, or "
            "--method data-parallel or auto"
        )
    if method == Method.DATA_PARALLEL and options.schedule != ScheduleChoice.AUTO:
        return (
            f"--schedule {options.schedule} orders a pipeline's microbatches; a data-parallel plan has one stage (its "
            "microbatches accumulate gradients): drop --schedule"
        )
    if method in PLACEMENT_METHODS:
        asked = [
            *([f"--remat {options.remat}"] if options.remat not in NO_RECOMPUTATION else []),
            *([f"--zero {zero}"] if zero not in (ZeroChoice.AUTO, ZeroChoice.OFF) else []),
            *([f"--schedule {options.schedule}"] if options.schedule != ScheduleChoice.AUTO else []),
        ]
        if asked:
            return (
                f"{', '.join(asked)}: the {method} placement runs every operator whole on one device under the "
                "dataflow schedule, without recomputation or sharded state: drop it or use another --method"
            )
    return None


def check_method_options(method: Method | str, options: PlanOptions) -> None:
    """Raise the refusal of :func:`method_option_refusal`, if any."""
    refusal = method_option_refusal(method, options)
    if refusal is not None:
        raise AutoplanError(refusal)


def does_not_fit_message(method: str, options: PlanOptions, setup: CostSetup, needed_bytes: float | None) -> str:
    """One line: what the smallest plan of ``method`` with the choices asked for needs, against the budget."""
    choices = options.asked_choices()
    plan_words = f"{method} plan" + (f" with {choices}" if choices else "")
    forced = options.grad_sync
    if forced is not None and needed_bytes is not None and needed_bytes <= setup.memory_budget_bytes:
        return (
            f"the {method} plan cannot run --grad-sync {forced.label}: it needs replicas on several devices "
            "(across nodes for local SGD), without --zero"
        )
    if needed_bytes is None:
        return f"no {plan_words} can be made for this model and cluster"
    return (
        f"does not fit: the smallest {plan_words} needs {gib_text(needed_bytes)} GiB per device, the budget is "
        f"{setup.describe_budget()}: add devices, lower the batch, or allow more (--zero, --remat)"
    )


def state_too_large_message(setup: CostSetup, num_params: int) -> str | None:
    """When the weights, gradients and optimizer state alone exceed the budget even split over every device (the
    least any layout holds: :func:`cost_models.memory.model_state_bytes` over ``N`` shards), the one change that
    helps — more devices, at least how many — since no batch, recomputation or ZeRO level can; None otherwise."""
    num_devices, budget = setup.cluster.num_devices, setup.memory_budget_bytes
    total = model_state_bytes(num_params, optimizer=setup.optimizer)
    if total / num_devices <= budget:
        return None
    return (
        f"does not fit: the weights, gradients and optimizer state ({setup.optimizer}) alone need "
        f"{gib_text(total / num_devices)} GiB per device even split over all {num_devices} devices, the budget is "
        f"{setup.describe_budget()}: no batch, recomputation or ZeRO level changes that; use at least "
        f"{math.ceil(total / budget)} devices at this budget"
    )


def gib_text(num_bytes: float) -> str:
    """``224.5`` GiB, or three significant figures below 1 GiB (``0.00723``)."""
    gib = num_bytes / GIB
    return f"{gib:.1f}" if gib >= 1 else f"{gib:.3g}"
