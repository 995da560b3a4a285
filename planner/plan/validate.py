"""Check a plan against its graph: :func:`validate_plan` raises :class:`~planner.plan.value.PlanError`
naming the first broken rule (schedule, microbatches, model fingerprint, devices, every node and
parameter placed once, every spec and strategy record well-formed for its tensor and mesh).
"""

from __future__ import annotations

import math
import re

from planner.errors import AutoplanError
from planner.ir.graph import OpGraph, OpNode, TensorMeta
from planner.ir.op_kinds import BATCH_STATISTICS
from planner.plan.schedules import MULTI_STAGE_SCHEDULES, Schedule, check_schedule
from planner.plan.stage import COLLECTIVE_KINDS, GATHERED, PHASES, ZERO_LEVELS, NodeSharding, Stage
from planner.plan.value import SCHEDULES, Plan, PlanError

_PLACEMENT = re.compile(r"^(R\*|R|P|S\((\d+)\))$")


def parse_placement(text: str) -> tuple[str, int | None]:
    """``"S(1)"`` -> ``("S", 1)``; ``"R"`` -> ``("R", None)``; ``"R*"`` -> ``("R*", None)``."""
    match = _PLACEMENT.match(text)
    if not match:
        raise PlanError(f"placement {text!r} is not one of S(d), R, R*, P")
    kind = GATHERED if match.group(1) == GATHERED else match.group(1)[0]
    return (kind, int(match.group(2)) if match.group(2) is not None else None)


def validate_plan(plan: Plan, graph: OpGraph) -> None:
    """Raise :class:`PlanError` naming the first broken rule; return None for a valid plan."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"schedule {plan.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if plan.batch_size <= 0 or plan.num_microbatches <= 0 or plan.batch_size % plan.num_microbatches:
        raise PlanError(f"batch size {plan.batch_size} cannot be split into {plan.num_microbatches} equal microbatches")
    if plan.schedule == Schedule.ONE_F_ONE_B and plan.num_microbatches < len(plan.stages):
        raise PlanError(
            f"schedule 1f1b needs at least as many microbatches as stages ({len(plan.stages)}), got "
            f"{plan.num_microbatches}: use gpipe, whose timeline is the same when microbatches are fewer"
        )
    if plan.schedule in MULTI_STAGE_SCHEDULES or plan.virtual_stages > 1:
        if len(plan.stages) % plan.num_pipeline_ranks:
            ranks = plan.num_pipeline_ranks
            raise PlanError(f"{len(plan.stages)} stages do not spread evenly over {ranks} pipeline ranks")
        try:
            check_schedule(
                plan.schedule,
                num_ranks=plan.num_pipeline_ranks,
                virtual_stages=plan.virtual_stages,
                num_microbatches=plan.num_microbatches,
            )
        except AutoplanError as error:
            raise PlanError(str(error)) from None
    if plan.model.fingerprint != graph.fingerprint():
        raise PlanError(f"plan was made for model {plan.model.fingerprint}, this model is {graph.fingerprint()}")
    _check_devices(plan)
    _check_once(
        "node", [(name, stage.index) for stage in plan.stages for name in stage.nodes], [n.name for n in graph.nodes]
    )
    _check_once(
        "parameter",
        [(name, stage.index) for stage in plan.stages for name in stage.param_placements],
        list(graph.param_names),
    )
    for stage in plan.stages:
        _check_stage_specs(stage, graph)
        _check_memory_choices(plan, stage, graph)


def _check_memory_choices(plan: Plan, stage: Stage, graph: OpGraph) -> None:
    """Recomputed runs are consecutive stage nodes, in order, none holding batch statistics (recomputing one would
    update its running statistics twice); ZeRO levels 2 and 3 run under FSDP only: on a data-parallel plan (one
    stage on several devices, every parameter replicated: :attr:`Plan.is_pure_data_parallel`), and so does CPU
    offload."""
    if stage.zero not in ZERO_LEVELS:
        raise PlanError(f"stage {stage.index}: ZeRO level {stage.zero} is not one of {list(ZERO_LEVELS)}")
    if stage.zero >= 2 and not plan.is_pure_data_parallel:
        raise PlanError(
            f"stage {stage.index}: ZeRO level {stage.zero} runs under FSDP, on a data-parallel plan only "
            "(one stage, every parameter replicated): use level 1 (optimizer state sharded) or 0"
        )
    if stage.offload and not (stage.zero >= 1 and plan.is_pure_data_parallel):
        raise PlanError(
            f"stage {stage.index}: CPU offload runs under FSDP, on a data-parallel plan at ZeRO level 1, 2 or 3 only"
        )
    if stage.remat_regions and not stage.remat:
        raise PlanError(f"stage {stage.index}: remat_regions without recomputation (remat is none)")
    position, last = {name: index for index, name in enumerate(stage.nodes)}, -1
    for first, final in stage.remat_regions:
        if first not in position or final not in position or not last < position[first] <= position[final]:
            raise PlanError(
                f"stage {stage.index}: remat region {first}..{final} is not a run of the stage's nodes "
                "after the previous region"
            )
        last = position[final]
    for run in stage.recomputed_runs():
        held = [name for name in run if graph.node(name).op_name in BATCH_STATISTICS]
        if held:
            raise PlanError(
                f"stage {stage.index}: {held[0]} keeps batch statistics and cannot be recomputed "
                "(its running statistics would be updated twice)"
            )


def _check_devices(plan: Plan) -> None:
    seen: dict[int, int] = {}
    ranks = plan.num_pipeline_ranks
    for stage in plan.stages:
        if stage.index >= ranks:  # a later virtual stage: on the devices of stage index mod P, nothing new
            home = plan.stages[stage.index % ranks]
            if (stage.devices, stage.mesh_shape) != (home.devices, home.mesh_shape):
                raise PlanError(
                    f"stage {stage.index} must run on stage {home.index}'s devices and mesh "
                    f"(virtual stages: stage k on the devices of stage k mod {ranks})"
                )
            continue
        if math.prod(stage.mesh_shape) != len(stage.devices) or any(size <= 0 for size in stage.mesh_shape):
            raise PlanError(
                f"stage {stage.index}: mesh shape {list(stage.mesh_shape)} does not hold its "
                f"{len(stage.devices)} devices (product must equal the device count)"
            )
        for device in stage.devices:
            if not 0 <= device < plan.cluster.num_devices:
                raise PlanError(
                    f"stage {stage.index}: device {device} is not in the cluster "
                    f"(ranks 0..{plan.cluster.num_devices - 1})"
                )
            if device in seen:
                raise PlanError(f"device {device} is used by stage {seen[device]} and stage {stage.index}")
            seen[device] = stage.index


def _check_once(what: str, placed: list[tuple[str, int]], expected: list[str]) -> None:
    where: dict[str, int] = {}
    for name, stage in placed:
        if name in where:
            raise PlanError(f"{what} {name} is placed twice (stage {where[name]} and stage {stage})")
        where[name] = stage
    known = set(expected)
    unknown = [name for name in where if name not in known]
    if unknown:
        raise PlanError(f"{what} {unknown[0]} is not in the model ({len(unknown)} unknown {what}s)")
    missing = [name for name in expected if name not in where]
    if missing:
        raise PlanError(f"{what} {missing[0]} is not placed in any stage ({len(missing)} missing)")


def _check_stage_specs(stage: Stage, graph: OpGraph) -> None:
    for name, spec in stage.param_placements.items():
        _check_spec(stage, f"parameter {name}", spec, graph.value(name).meta, must_divide=True)
    unknown = [name for name in stage.strategies if name not in set(stage.nodes)]
    if unknown:
        raise PlanError(f"stage {stage.index}: strategies names {unknown[0]}, which is not a node of this stage")
    for name in stage.nodes:
        if name not in stage.strategies:
            raise PlanError(f"stage {stage.index}: node {name} has no strategy (every node of a stage needs one)")
        _check_strategy(stage, graph.node(name), stage.strategies[name])


def _check_strategy(stage: Stage, node: OpNode, record: NodeSharding) -> None:
    where = f"stage {stage.index}: node {node.name}"
    if len(record.input_specs) != len(node.inputs):
        raise PlanError(f"{where} has {len(record.input_specs)} input specs for its {len(node.inputs)} inputs")
    for position, (spec, meta) in enumerate(zip(record.input_specs, node.input_metas, strict=True)):
        if spec is not None:
            _check_spec(stage, f"node {node.name} input {position}", tuple(spec), meta, must_divide=True)
    _check_spec(stage, f"node {node.name}", record.output_spec, node.output, must_divide=True)
    devices = math.prod(stage.mesh_shape)
    if record.compute_shards < 1 or devices % record.compute_shards:
        raise PlanError(f"{where}: compute_shards {record.compute_shards} does not divide its {devices} devices")
    for collective in record.collectives:
        if collective.kind not in COLLECTIVE_KINDS or collective.phase not in PHASES:
            raise PlanError(
                f"{where}: collective {collective.kind} in phase {collective.phase} is not one of "
                f"{', '.join(COLLECTIVE_KINDS)} in {', '.join(PHASES)}"
            )
        if not 0 <= collective.axis < len(stage.mesh_shape):
            raise PlanError(f"{where}: collective on axis {collective.axis} of a {len(stage.mesh_shape)}-axis mesh")
        if collective.operand is not None and not 0 <= collective.operand < len(node.inputs):
            raise PlanError(f"{where}: collective on input {collective.operand}, the node has {len(node.inputs)}")


def _check_spec(stage: Stage, what: str, spec: tuple[str, ...], meta: TensorMeta, *, must_divide: bool) -> None:
    if len(spec) != len(stage.mesh_shape):
        raise PlanError(
            f"stage {stage.index}: {what} has {len(spec)} placements {list(spec)} for a "
            f"{len(stage.mesh_shape)}-axis mesh {list(stage.mesh_shape)}"
        )
    shards_per_dim: dict[int, int] = {}
    for axis, text in enumerate(spec):
        kind, dim = parse_placement(text)
        if kind != "S":
            continue
        assert dim is not None
        if dim >= len(meta.shape):
            raise PlanError(
                f"stage {stage.index}: {what} placement {text} names dim {dim} of a {len(meta.shape)}-d tensor"
            )
        shards_per_dim[dim] = shards_per_dim.get(dim, 1) * stage.mesh_shape[axis]
    for dim, shards in shards_per_dim.items():
        if must_divide and meta.shape[dim] % shards:
            raise PlanError(
                f"stage {stage.index}: {what} dim {dim} of size {meta.shape[dim]} cannot be split into {shards} shards"
            )
