"""A plan is a value: frozen, keyword-only dataclasses with a JSON round-trip and validation.

JSON layout (``format_version`` 2)::

    {format_version, method, model: {file, args, fingerprint, tracer, num_params},
     cluster: {...Cluster.to_json()}, batch_size, num_microbatches, schedule, optimizer, zero,
     stages: [{index, nodes, devices, mesh_shape, param_placements, remat, explanation,
               strategies: {node: {split, input_specs, output_spec, compute_shards,
                                   collectives: [{kind, axis, phase, operand}]}}}],
     estimate: {step_time_s, per_stage_time_s, memory_per_device_bytes, bubble_fraction,
                tflops_per_device, mfu, breakdown_s}, search: {time_s, capture_s, ...}, notes}

The plan is the program: every node's :class:`NodeSharding` is the strategy the search chose, and
the simulator, ``plan show``, ``plan run`` and the executors read it as it is — the spec each
tensor operand is consumed in (an activation is redistributed to it, a parameter is held in it),
the output spec, the factor its compute is split by, and the collectives it issues. Version 1
plans stored only output specs and cannot be read (re-plan).

A placement is one of ``"S(d)"`` (shard tensor dim d), ``"R"`` (replicate) or ``"P"``
(partial sum), one per mesh axis. :func:`validate_plan` checks the plan against its graph.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cost_models.atomic_file import write_text_atomic
from cost_models.cluster import Cluster
from planner.errors import AutoplanError
from planner.graph import OpGraph, OpNode, TensorMeta

FORMAT_VERSION = 2
SCHEDULES = ("none", "gpipe", "1f1b", "dataflow")  # dataflow: op placements, each op runs when its inputs arrive
_PLACEMENT = re.compile(r"^(R|P|S\((\d+)\))$")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
PHASES = ("forward", "backward", "sync")  # per microbatch, per microbatch, once per step


class PlanError(AutoplanError):
    """A plan that breaks a rule: the message names the offending values."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """A collective a node issues: ``kind`` over mesh ``axis`` in ``phase`` on ``operand`` (the position
    of one of the node's inputs; None: its output). ``forward``: the all-reduce of a partial sum;
    ``backward``: the all-reduce of a replicated input's gradient; ``sync``: a parameter's gradient
    all-reduce, once per step."""

    kind: str
    axis: int
    phase: str
    operand: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "phase": self.phase, "operand": self.operand}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Collective:
        operand = data.get("operand")
        return cls(kind=str(data["kind"]), axis=int(data["axis"]), phase=str(data["phase"]),
                   operand=None if operand is None else int(operand))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class NodeSharding:
    """The strategy the search chose for one node, as the executors run it and the simulator prices it.

    ``input_specs`` has one entry per node input: the spec an activation is redistributed to before
    the node runs, the spec a parameter is held in, or None for a buffer or an argument read only
    for its shape. ``split`` names what each mesh axis splits (the strategy's name)."""

    split: str
    input_specs: tuple[tuple[str, ...] | None, ...]
    output_spec: tuple[str, ...]
    compute_shards: int = 1
    collectives: tuple[Collective, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "input_specs": [None if spec is None else list(spec) for spec in self.input_specs],
            "output_spec": list(self.output_spec),
            "compute_shards": self.compute_shards,
            "collectives": [collective.to_json() for collective in self.collectives],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeSharding:
        return cls(
            split=str(data["split"]),
            input_specs=tuple(None if spec is None else tuple(spec) for spec in data["input_specs"]),
            output_spec=tuple(data["output_spec"]),
            compute_shards=int(data.get("compute_shards", 1)),
            collectives=tuple(Collective.from_json(c) for c in data.get("collectives", ())),
        )


@dataclass(frozen=True, kw_only=True)
class Stage:
    index: int
    nodes: tuple[str, ...]
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    strategies: Mapping[str, NodeSharding] = field(default_factory=dict)  # every node's, by name
    param_placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    remat: bool = False
    explanation: tuple[Mapping[str, Any], ...] = ()  # per node: split, spec and seconds (planner.explain)

    @property
    def output_specs(self) -> dict[str, tuple[str, ...]]:
        """Node name -> its output spec (from its strategy)."""
        return {name: record.output_spec for name, record in self.strategies.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "nodes": list(self.nodes),
            "devices": list(self.devices),
            "mesh_shape": list(self.mesh_shape),
            "strategies": {name: record.to_json() for name, record in self.strategies.items()},
            "param_placements": {name: list(spec) for name, spec in self.param_placements.items()},
            "remat": self.remat,
            "explanation": [dict(row) for row in self.explanation],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Stage:
        return cls(
            index=int(data["index"]),
            nodes=tuple(data["nodes"]),
            devices=tuple(int(d) for d in data["devices"]),
            mesh_shape=tuple(int(s) for s in data["mesh_shape"]),
            strategies={name: NodeSharding.from_json(record) for name, record in data["strategies"].items()},
            param_placements={k: tuple(v) for k, v in data.get("param_placements", {}).items()},
            remat=bool(data.get("remat", False)),
            explanation=tuple(dict(row) for row in data.get("explanation", ())),
        )


@dataclass(frozen=True, kw_only=True)
class Estimate:
    step_time_s: float
    per_stage_time_s: tuple[float, ...]
    memory_per_device_bytes: int
    bubble_fraction: float
    tflops_per_device: float
    mfu: float = 0.0
    breakdown_s: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "per_stage_time_s": list(self.per_stage_time_s),
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "bubble_fraction": self.bubble_fraction,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "breakdown_s": dict(self.breakdown_s),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Estimate:
        return cls(
            step_time_s=float(data["step_time_s"]),
            per_stage_time_s=tuple(float(t) for t in data.get("per_stage_time_s", ())),
            memory_per_device_bytes=int(data["memory_per_device_bytes"]),
            bubble_fraction=float(data["bubble_fraction"]),
            tflops_per_device=float(data["tflops_per_device"]),
            mfu=float(data.get("mfu", 0.0)),
            breakdown_s=dict(data.get("breakdown_s", {})),
        )


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    time_s: float
    capture_s: float = 0.0
    cost_s: float = 0.0
    ilp_solves: int = 0
    ilp_s: float = 0.0  # building and solving the intra-op problems of layers
    dp_s: float = 0.0  # the stage DP and the hand-written grid
    price_s: float = 0.0  # re-pricing candidates on whole stages

    def to_json(self) -> dict[str, Any]:
        return {
            "time_s": self.time_s,
            "capture_s": self.capture_s,
            "cost_s": self.cost_s,
            "ilp_solves": self.ilp_solves,
            "ilp_s": self.ilp_s,
            "dp_s": self.dp_s,
            "price_s": self.price_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SearchStats:
        return cls(
            time_s=float(data["time_s"]),
            capture_s=float(data.get("capture_s", 0.0)),
            cost_s=float(data.get("cost_s", 0.0)),
            ilp_solves=int(data.get("ilp_solves", 0)),
            ilp_s=float(data.get("ilp_s", 0.0)),
            dp_s=float(data.get("dp_s", 0.0)),
            price_s=float(data.get("price_s", 0.0)),
        )


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """Where the model came from, so executors can rebuild and check it."""

    fingerprint: str
    num_params: int
    file: str | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    tracer: str = "export"

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "args": dict(self.args),
            "fingerprint": self.fingerprint,
            "tracer": self.tracer,
            "num_params": self.num_params,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelRef:
        return cls(
            file=data.get("file"),
            args=dict(data.get("args", {})),
            fingerprint=str(data["fingerprint"]),
            tracer=str(data.get("tracer", "export")),
            num_params=int(data.get("num_params", 0)),
        )


@dataclass(frozen=True, kw_only=True)
class Plan:
    method: str
    model: ModelRef
    cluster: Cluster
    batch_size: int
    num_microbatches: int
    schedule: str
    optimizer: str
    stages: tuple[Stage, ...]
    estimate: Estimate
    search: SearchStats
    notes: tuple[str, ...] = ()
    zero: bool = False  # optimizer state and gradients sharded over data-parallel axes
    format_version: int = FORMAT_VERSION

    @property
    def num_devices(self) -> int:
        return sum(len(stage.devices) for stage in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "method": self.method,
            "model": self.model.to_json(),
            "cluster": self.cluster.to_json(),
            "batch_size": self.batch_size,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "optimizer": self.optimizer,
            "zero": self.zero,
            "stages": [stage.to_json() for stage in self.stages],
            "estimate": self.estimate.to_json(),
            "search": self.search.to_json(),
            "notes": list(self.notes),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise PlanError(
                f"plan format_version {version!r} is not one this autoplan reads ({FORMAT_VERSION}): "
                "re-plan the model with `plan MODEL_FILE ...` to get a plan it can run"
            )
        try:
            return cls(
                method=str(data["method"]),
                model=ModelRef.from_json(data["model"]),
                cluster=Cluster.from_json(data["cluster"], source="plan"),
                batch_size=int(data["batch_size"]),
                num_microbatches=int(data["num_microbatches"]),
                schedule=str(data["schedule"]),
                optimizer=str(data.get("optimizer", "adam-mixed")),
                zero=bool(data.get("zero", False)),
                stages=tuple(Stage.from_json(stage) for stage in data["stages"]),
                estimate=Estimate.from_json(data["estimate"]),
                search=SearchStats.from_json(data["search"]),
                notes=tuple(data.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"plan JSON is malformed: {type(error).__name__} {error}") from None


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write atomically: a crash leaves either the old file or the new one, never half."""
    write_text_atomic(Path(path), plan.dumps() + "\n", what="plan file")


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PlanError(f"plan file {path} is not valid JSON: {error}") from None
    return Plan.from_json(data)


def parse_placement(text: str) -> tuple[str, int | None]:
    """``"S(1)"`` -> ``("S", 1)``; ``"R"`` -> ``("R", None)``."""
    match = _PLACEMENT.match(text)
    if not match:
        raise PlanError(f"placement {text!r} is not one of S(d), R, P")
    return (match.group(1)[0], int(match.group(2)) if match.group(2) is not None else None)


def validate_plan(plan: Plan, graph: OpGraph) -> None:
    """Raise :class:`PlanError` naming the first broken rule; return None for a valid plan."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"schedule {plan.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if plan.batch_size <= 0 or plan.num_microbatches <= 0 or plan.batch_size % plan.num_microbatches:
        raise PlanError(f"batch size {plan.batch_size} cannot be split into {plan.num_microbatches} equal microbatches")
    if plan.schedule == "1f1b" and plan.num_microbatches < len(plan.stages):
        raise PlanError(
            f"schedule 1f1b needs at least as many microbatches as stages ({len(plan.stages)}), got "
            f"{plan.num_microbatches}: use gpipe, whose timeline is the same when microbatches are fewer"
        )
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


def _check_devices(plan: Plan) -> None:
    seen: dict[int, int] = {}
    for stage in plan.stages:
        if math.prod(stage.mesh_shape) != len(stage.devices) or any(size <= 0 for size in stage.mesh_shape):
            raise PlanError(
                f"stage {stage.index}: mesh shape {list(stage.mesh_shape)} does not hold its "
                f"{len(stage.devices)} devices (product must equal the device count)"
            )
        for device in stage.devices:
            if not 0 <= device < plan.cluster.num_devices:
                raise PlanError(
                    f"stage {stage.index}: device {device} is not in the cluster (ranks 0..{plan.cluster.num_devices - 1})"
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
    unknown = [name for name in where if name not in set(expected)]
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
