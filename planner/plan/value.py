"""A plan is a value: frozen, keyword-only dataclasses with a JSON round-trip and validation.

JSON layout (``format_version`` 2)::

    {format_version, method, model: {file, args, fingerprint, tracer, num_params},
     cluster: {...Cluster.to_json()}, batch_size, num_microbatches, schedule, optimizer, zero,
     memory_fraction, grad_sync: {kind, rank, period, warmup_steps} (planner.plan.grad_sync; absent: exact),
     runtime (planner.costing.runtime_profiles; absent: autoplan),
     stages: [{index, nodes, devices, mesh_shape, param_placements, remat, remat_regions, zero, explanation,
               memory_saving, sequence_parallel_saving (planner.plan.choices; absent: {}),
               strategies: {node: {split, input_specs, output_spec, compute_shards,
                                   collectives: [{kind, axis, phase, operand}]}}}],
     estimate: {step_time_s, per_stage_time_s, memory_per_device_bytes, bubble_fraction,
                tflops_per_device, mfu, breakdown_s (parts adding up to the step), hidden_s, savings}, search: {time_s, capture_s, ...}, notes}

The plan is the program: every node's :class:`NodeSharding` is the strategy the search chose, and
the simulator, ``plan show``, ``plan run`` and the executors read it as it is — the spec each
tensor operand is consumed in (an activation is redistributed to it, a parameter is held in it),
the output spec, the factor its compute is split by, and the collectives it issues. Version 1
plans stored only output specs and cannot be read (re-plan).

A placement is one of ``"S(d)"`` (shard tensor dim d), ``"R"`` (replicate), ``"R*"`` (replicate, the
gradient handed back as partial sums: sequence parallelism's gathered tensors) or ``"P"`` (partial sum),
one per mesh axis. :func:`validate_plan` checks the plan against its graph.

``model.file`` is absolute in plans made by ``plan`` (:func:`planner.api.prepare_model_file`);
:func:`load_plan` finds a relative one (older plans) beside the plan file, then in the current
directory, and returns the plan with that path made absolute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cost_models.cluster import Cluster, memory_budget_bytes
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError
from planner.plan.grad_sync import GradSync
from planner.plan.stage import Stage

FORMAT_VERSION = 2
# dataflow: op placements, each op runs when its inputs arrive; interleaved and zero-bubble may hold several stages
# per pipeline rank (stage k on the devices of stage k mod P: planner.plan.schedules)
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "zero-bubble", "dataflow")


class PlanError(AutoplanError):
    """A plan that breaks a rule: the message names the offending values."""


BREAKDOWN_TOLERANCE = 1e-9  # relative: float rounding between a step and the sum of its parts


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What a plan is expected to cost per step.

    ``breakdown_s``: the parts of the step, each non-negative, adding up to ``step_time_s`` (:meth:`breakdown_error`
    says where they do not). ``hidden_s``: work that runs behind the step's parts and is not added to them (the
    gradient all-reduce the backward pass hides). ``savings``: what a choice saved against the option it replaced
    (``schedule_saved_s``, ``schedule_saved_bytes``, ``grad_sync_saved_s``; read by :mod:`planner.plan.choices`).
    """

    step_time_s: float
    per_stage_time_s: tuple[float, ...]
    memory_per_device_bytes: int
    bubble_fraction: float
    tflops_per_device: float
    mfu: float = 0.0
    breakdown_s: Mapping[str, float] = field(default_factory=dict)
    hidden_s: Mapping[str, float] = field(default_factory=dict)
    savings: Mapping[str, float] = field(default_factory=dict)

    def breakdown_error(self) -> str | None:
        """Why the breakdown is not the step cut into non-negative parts; None when it is."""
        negative = {key: value for key, value in self.breakdown_s.items() if value < 0}
        if negative:
            return f"negative parts {negative}"
        total = math.fsum(self.breakdown_s.values())
        if not math.isclose(total, self.step_time_s, rel_tol=BREAKDOWN_TOLERANCE, abs_tol=1e-15):
            return f"parts add up to {total!r} s, the step is {self.step_time_s!r} s"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "per_stage_time_s": list(self.per_stage_time_s),
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "bubble_fraction": self.bubble_fraction,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "breakdown_s": dict(self.breakdown_s),
            "hidden_s": dict(self.hidden_s),
            "savings": dict(self.savings),
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
            hidden_s=dict(data.get("hidden_s", {})),
            savings=dict(data.get("savings", {})),
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
    # rows each batch-normalization call computes its statistics over (0: the model has none)
    batch_stat_rows: int = 0
    memory_fraction: float = 1.0  # --memory-fraction: the share of the usable memory the plan was made for
    # exact unless the user allowed a lossy one (planner.plan.grad_sync)
    grad_sync: GradSync = field(default_factory=GradSync)
    # the runtime the estimate describes (planner.costing.runtime_profiles): autoplan, our executors, unless --runtime
    runtime: str = "autoplan"
    format_version: int = FORMAT_VERSION

    @property
    def num_devices(self) -> int:
        return len({device for stage in self.stages for device in stage.devices})

    @property
    def zero(self) -> int:
        """The highest ZeRO level of the stages (each stage has its own: ``Stage.zero``)."""
        return max((stage.zero for stage in self.stages), default=0)

    @property
    def num_pipeline_ranks(self) -> int:
        """P: the distinct device groups the stages run on (stage k on group k mod P)."""
        return len({stage.devices for stage in self.stages})

    @property
    def virtual_stages(self) -> int:
        """v: stages per pipeline rank (1 but under the interleaved and zero-bubble schedules)."""
        return len(self.stages) // max(1, self.num_pipeline_ranks)

    @property
    def memory_budget_bytes(self) -> float:
        """Bytes per device the plan was made to fit in: (capacity - reserve) x memory_fraction."""
        return memory_budget_bytes(self.cluster, memory_fraction=self.memory_fraction)

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
            "memory_fraction": self.memory_fraction,
            "batch_stat_rows": self.batch_stat_rows,
            "grad_sync": self.grad_sync.to_json(),
            "runtime": self.runtime,
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
                memory_fraction=float(data.get("memory_fraction", 1.0)),
                batch_stat_rows=int(data.get("batch_stat_rows", 0)),
                grad_sync=GradSync.from_json(data.get("grad_sync")),
                runtime=str(data.get("runtime", "autoplan")),
                stages=_stages_from_json(data),
                estimate=Estimate.from_json(data["estimate"]),
                search=SearchStats.from_json(data["search"]),
                notes=tuple(data.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"plan JSON is malformed: {type(error).__name__} {error}") from None


def _stages_from_json(data: Mapping[str, Any]) -> tuple[Stage, ...]:
    """The stages; a plan stored before stages had ZeRO levels says ``zero: true`` for the whole plan (optimizer
    state and gradients sharded): level 2 on a data-parallel plan (FSDP), 1 on the stages of any other."""
    stages = tuple(Stage.from_json(stage) for stage in data["stages"])
    if data.get("zero") is not True or any("zero" in stage for stage in data["stages"]):
        return stages
    data_parallel = len(stages) == 1 and all(set(spec) == {"R"} for spec in stages[0].param_placements.values())
    return tuple(replace(stage, zero=(2 if data_parallel else 1) if len(stage.devices) > 1 else 0) for stage in stages)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write atomically: a crash leaves either the old file or the new one, never half."""
    write_text_atomic(Path(path), plan.dumps() + "\n", what="plan file")


def load_plan(path: str | Path) -> Plan:
    """The plan at ``path``, its model file found (see :func:`find_model_file`) and made absolute."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PlanError(f"plan file {path} is not valid JSON: {error}") from None
    plan = Plan.from_json(data)
    if plan.model.file is None:  # planned from Python: nothing to find
        return plan
    found = find_model_file(plan.model.file, plan_path=path)
    return replace(plan, model=replace(plan.model, file=str(found)))


def find_model_file(file: str, *, plan_path: Path) -> Path:
    """The model file a plan names: an absolute path as it is; a relative one (plans made before paths
    were stored absolute) beside the plan file first, then in the current directory."""
    stored = Path(file)
    if stored.is_absolute():
        if stored.is_file():
            return stored
        raise PlanError(
            f'model file {file} of plan {plan_path} not found: it moved? re-plan, or edit "model.file" in the plan'
        )
    places = (plan_path.resolve().parent, Path.cwd())
    for folder in places:
        if (folder / stored).is_file():
            return (folder / stored).resolve()
    raise PlanError(
        f"model file {file} of plan {plan_path} not found (looked in {places[0]} and {places[1]}): it moved? "
        're-plan, or edit "model.file" in the plan'
    )
