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

When no plan fits, the message (:func:`does_not_fit_message`, and auto's) names the least memory per device a
plan of the method needs, the budget, and the smallest changes that fit, computed from the smallest plan's estimate
split into its state ``S`` (weights, gradients, optimizer state) and activations ``A`` on its fullest device
(:class:`MemoryParts`, :func:`fit_advice`); only advice that can help is given:

* more devices, when the state alone exceeds the budget even split over every device
  (:func:`state_too_large_message`): at least ``⌈total state / budget⌉``, and nothing else;
* a ZeRO level the method runs above the one asked for (``--zero``: 1 for ``megatron`` and ``uniform-pipeline``,
  up to 3 for ``data-parallel`` and ``auto``): the first level whose re-priced memory is within the budget — a
  one-stage data-parallel plan re-priced as FSDP holds it (``MemoryParts.at_zero``), any other plan ``S_k + A``
  with ``S`` re-priced by :func:`cost_models.memory.model_state_bytes` with the level's shards over the plan's
  ``d`` replicas (:func:`cost_models.memory.zero_shards`);
* a smaller batch, when ``S`` fits: activations scale with the rows per replica, so the largest batch
  ``B' ≤ B·(budget − S)/A`` that the plan's ``m`` microbatches and ``d`` replicas divide;
* recomputation (``--remat``) when it was turned off and ``S`` fits (it cuts ``A``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from cost_models.memory import model_state_bytes, optimizer_bytes, zero_shards
from cost_models.units import GIB
from planner.costing.compression import requirements
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


@dataclass(frozen=True, kw_only=True)
class MemoryParts:
    """The fullest device of the smallest plan that does not fit, from its estimate."""

    state_bytes: float  # its weights, gradients and optimizer state
    activation_bytes: float  # what its in-flight microbatches hold: proportional to the rows per replica
    zero: int  # the ZeRO level it holds its state at
    data_degree: int  # the replicas a ZeRO level shards its state over
    num_microbatches: int
    # the plan's whole memory re-priced at other ZeRO levels where the caller can (FSDP's, as the estimate holds it)
    at_zero: Mapping[int, float] = field(default_factory=dict)
    # of activation_bytes, the model outputs and the loss on them, held once by the stage that computes them
    # (planner.inter.layer_costs.loss_and_output_bytes); 0 where the caller does not split them out
    output_bytes: float = 0.0
    # the pieces the last stage cuts its outputs' rows into (planner.plan.stage.loss_row_axes): a batch advised
    # keeps them whole pieces, so the loss stays on each rank's rows
    loss_row_split: int = 1

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes


def _state_at(parts: MemoryParts, level: int, optimizer: str) -> float:
    """``parts.state_bytes`` re-priced at ZeRO ``level``: the same parameters, their parts split by the level's
    shards over the data replicas."""
    per = optimizer_bytes(optimizer)
    d = parts.data_degree
    weights, grads, state = zero_shards(parts.zero, d)
    held = parts.state_bytes / (per.weights / weights + per.grads / grads + per.state / state)  # parameters
    weights, grads, state = zero_shards(level, d)
    return model_state_bytes(held, optimizer=optimizer, weight_shards=weights, grad_shards=grads, state_shards=state)


def _zero_advice(method: str, options: PlanOptions, setup: CostSetup, parts: MemoryParts) -> str | None:
    """``--zero 2 (about 11.2 GiB)``: the lowest level above the one asked for that fits; None if none does, or
    when the level was left to the planner (the smallest plan already had the choice)."""
    if options.zero == ZeroChoice.AUTO or parts.data_degree == 1:
        return None
    top = 1 if method in SHARDED_STATE_METHODS else 3
    for level in range(parts.zero + 1, top + 1):
        needed = parts.at_zero.get(level, _state_at(parts, level, setup.optimizer) + parts.activation_bytes)
        if needed <= setup.memory_budget_bytes:
            return f"--zero {level} (about {gib_text(needed)} GiB)"
    return None


def _batch_advice(parts: MemoryParts, setup: CostSetup, batch_size: int) -> str | None:
    """``--batch-size 8 or less``: the largest batch the linear activation term allows, a multiple of the plan's
    microbatches times replicas; None when the state alone is over the budget or no such batch is left."""
    room = setup.memory_budget_bytes - parts.state_bytes
    if room <= 0 or parts.activation_bytes <= 0:
        return None
    unit = parts.num_microbatches * math.lcm(parts.data_degree, parts.loss_row_split)
    largest = math.floor(batch_size * room / parts.activation_bytes / unit) * unit
    return f"--batch-size {largest} or less" if 0 < largest < batch_size else None


def _devices_advice(parts: MemoryParts, setup: CostSetup, batch_size: int) -> str | None:
    """``about 24 devices``: more replicas, fewer rows each, until the activations fit beside the state (the
    activations scale with the rows per replica); None when the state alone is over the budget, or when it would
    take less than one row per replica and microbatch. Outputs held whole (``MemoryParts.output_bytes``) are the
    whole microbatch's however many replicas there are: they take room, they do not shrink."""
    devices = setup.cluster.num_devices
    room = setup.memory_budget_bytes - parts.state_bytes - parts.output_bytes
    scaling = parts.activation_bytes - parts.output_bytes
    if room <= 0 or scaling <= 0:
        return None
    needed = math.ceil(devices * scaling / room)
    rows = batch_size / (parts.num_microbatches * parts.data_degree)  # per replica and microbatch
    return f"about {needed} devices" if devices < needed <= devices * rows else None


def fit_advice(
    method: str, options: PlanOptions, setup: CostSetup, *, parts: MemoryParts | None, batch_size: int
) -> list[str]:
    """The smallest changes that fit, from the smallest plan's estimate in ``parts`` (module docstring)."""
    if parts is None:
        return []
    advice = [
        _zero_advice(method, options, setup, parts),
        _batch_advice(parts, setup, batch_size),
        _devices_advice(parts, setup, batch_size),
    ]
    if options.remat == RematChoice.OFF and parts.state_bytes < setup.memory_budget_bytes:
        advice.append("recomputation (--remat full) to cut the activations")
    return [entry for entry in advice if entry is not None]


def advice_text(advice: list[str], *, otherwise: str) -> str:
    """``by its estimate it fits with --zero 1 (about 9.9 GiB), --batch-size 8 or less or about 24 devices``;
    ``otherwise`` when there is no advice."""
    if not advice:
        return otherwise
    listed = advice[0] if len(advice) == 1 else f"{', '.join(advice[:-1])} or {advice[-1]}"
    return f"by its estimate it fits with {listed}"


def parts_text(parts: MemoryParts | None) -> str:
    """`` (state 9.1 GiB + activations 15.3 GiB)``, or nothing without parts; where the model outputs and the loss
    are most of the activations (over half), says so: they are the whole microbatch's on each device of the stage
    (``StageSharding.leave`` hands the loss whole outputs; ``--runtime megatron-lm-2021`` prices Megatron-LM's
    shares instead)."""
    if parts is None:
        return ""
    text = f" (state {gib_text(parts.state_bytes)} GiB + activations {gib_text(parts.activation_bytes)} GiB"
    if parts.output_bytes > parts.activation_bytes / 2:
        text += (
            f", {gib_text(parts.output_bytes)} GiB of them the model's outputs and the loss on them, whole on each"
            " device of the last stage"
        )
    return text + ")"


def _otherwise(parts: MemoryParts | None, options: PlanOptions) -> str:
    """What to say when no change is computed: the generic changes without parts to compute from."""
    if parts is None:
        return "add devices, lower the batch, or allow more (--zero, --remat)"
    other = "other --degrees or --method auto" if options.degrees is not None else "--method auto"
    return f"no smaller batch, higher ZeRO level or more replicas fits this method's plans: try {other}"


def does_not_fit_message(
    method: str,
    options: PlanOptions,
    setup: CostSetup,
    needed_bytes: float | None,
    *,
    parts: MemoryParts | None = None,
    batch_size: int = 0,
    num_params: int = 0,
) -> str:
    """One line: what the smallest plan of ``method`` with the choices asked for needs, against the budget, and the
    changes that fit (:func:`fit_advice`); the state alone over every device first (:func:`state_too_large_message`).
    """
    choices = options.asked_choices()
    plan_words = f"{method} plan" + (f" with {choices}" if choices else "")
    forced = options.grad_sync
    if forced is not None and needed_bytes is not None and needed_bytes <= setup.memory_budget_bytes:
        return f"the {method} plan cannot run --grad-sync {forced.label}: it needs {requirements(forced)}"
    state = state_too_large_message(setup, num_params) if num_params else None
    if state is not None:
        return state
    if needed_bytes is None:
        return f"cannot make a {plan_words} for this model and cluster"
    if needed_bytes <= setup.memory_budget_bytes:  # the approximate smallest fits: the exact pricing refused them
        return (
            f"cannot make a {plan_words}: by the layer-table estimate its smallest configuration needs "
            f"{gib_text(needed_bytes)} GiB per device, within the budget of {gib_text(setup.memory_budget_bytes)} GiB, "
            "but the configurations priced exactly could not be laid out on this model (fewer layers than pipeline "
            "stages × virtual stages, or a batch its microbatches and replicas do not divide) or needed more once "
            "priced exactly: try fewer pipeline stages, another --schedule or --microbatches, a smaller batch, or "
            "--method auto"
        )
    advice = fit_advice(method, options, setup, parts=parts, batch_size=batch_size)
    return (
        f"does not fit: the smallest {plan_words} needs {gib_text(needed_bytes)} GiB per device{parts_text(parts)}, "
        f"the budget is {setup.describe_budget()}: " + advice_text(advice, otherwise=_otherwise(parts, options))
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
        f"{gib_text(total / num_devices)} GiB "
        + (f"per device even split over all {num_devices} devices" if num_devices > 1 else "on the one device")
        + f", the budget is {setup.describe_budget()}: no batch, recomputation or ZeRO level changes that; "
        f"use at least {math.ceil(total / budget)} devices at this budget"
    )


def gib_text(num_bytes: float) -> str:
    """``224.5`` GiB, or three significant figures below 1 GiB (``0.00723``)."""
    gib = num_bytes / GIB
    return f"{gib:.1f}" if gib >= 1 else f"{gib:.3g}"
