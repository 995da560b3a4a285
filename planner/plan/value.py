"""A plan is a value: frozen, keyword-only dataclasses, written as JSON by the generic codec, and validated.

JSON layout (``format_version`` 3): the fields of :class:`Plan`, each nested dataclass an object of its fields
(:mod:`planner.plan.codec`; the schema, generated from these types, is ``docs/plan-schema.json``,
:mod:`planner.plan.schema`)::

    {format_version, method, model: {fingerprint, num_params, file, args, tracer, sequence_length},
     cluster: {...Cluster.to_json()},
     batch_size, num_microbatches, schedule, optimizer,
     stages: [{index, nodes, devices, mesh_shape,
               strategies: {node: {split, input_specs, output_spec, compute_shards,
                                   collectives: [{kind, axis, phase, operand}]}},
               param_placements, remat, remat_regions, zero,
               memory_saving: {choice, next_best, saved_s, saved_bytes, next_best_remat, next_best_zero} | null,
               sequence_parallel_saving: {choice, next_best, saved_s, saved_bytes} | null,
               explanation: [{node, target, strategy, spec, compute_s, comm_s, step_s, reshard_s, memory_bytes,
                              all_reduces}]}],
     estimate: {step_time_s, per_stage_time_s, memory_per_device_bytes, bubble_fraction, tflops_per_device, mfu,
                breakdown_s (parts adding up to the step), hidden_s,
                savings: {schedule_saved_s, schedule_saved_bytes, grad_sync_saved_s}},
     search: {time_s, capture_s, ...}, notes, batch_stat_rows, memory_fraction,
     grad_sync: {kind, rank, period, warmup_steps} (planner.plan.grad_sync),
     runtime (planner.costing.runtime_profiles), loss_bytes_per_output_element (cost_models.loss_memory),
     megatron: {global_batch_size, micro_batch_size, num_microbatches, tensor_parallel, pipeline_parallel, ...}}

A field with a default may be left out (it takes the default); an unknown field is an error. ``megatron`` is
derived, read-only: the plan in Megatron-LM's terms (:func:`planner.plan.megatron_terms.megatron_terms`), written
by :meth:`Plan.to_json` on every save and ignored by :meth:`Plan.from_json`, which recomputes it from the plan
(``Plan.megatron``): a derived value that is not read cannot disagree with the plan it describes. The summary
``plan`` prints is :meth:`Plan.summary` (and ``print(plan)``; :func:`planner.plan.report.plan_summary`): the
report reads the plan through :class:`planner.plan.parts.PlanView` and its parts (:mod:`planner.plan.parts`), so
neither imports the other's module in a cycle.

The plan is the program: every node's :class:`NodeSharding` is the strategy the search chose, and
the simulator, ``plan show``, ``plan run`` and the executors read it as it is — the spec each
tensor operand is consumed in (an activation is redistributed to it, a parameter is held in it),
the output spec, the factor its compute is split by, and the collectives it issues. Plans of an older
``format_version`` (1: output specs only; 2: savings and explanations as free-form objects) are refused
with one line that says to re-plan.

A placement is one of ``"S(d)"`` (shard tensor dim d), ``"R"`` (replicate), ``"R*"`` (replicate, the
gradient handed back as partial sums: sequence parallelism's gathered tensors) or ``"P"`` (partial sum),
one per mesh axis. :func:`validate_plan` checks the plan against its graph.

``model.file`` is absolute in plans made by ``plan`` (:func:`planner.api.prepare_model_file`);
:func:`load_plan` finds a relative one (a hand-written plan) beside the plan file, then in the current
directory, and returns the plan with that path made absolute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cost_models.cluster import Cluster, memory_budget_bytes
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError
from planner.plan.codec import Codec, CodecError, External
from planner.plan.grad_sync import GradSync
from planner.plan.megatron_terms import MegatronTerms, PlanFigures, megatron_terms
from planner.plan.method import Method
from planner.plan.parts import Estimate, ModelRef, SearchStats
from planner.plan.report import plan_summary
from planner.plan.schedules import Schedule
from planner.plan.stage import Stage

FORMAT_VERSION = 3
# dataflow: op placements, each op runs when its inputs arrive; interleaved and zero-bubble may hold several stages
# per pipeline rank (stage k on the devices of stage k mod P: planner.plan.schedules)
SCHEDULES = tuple(Schedule)


class PlanError(AutoplanError):
    """A plan that breaks a rule: the message names the offending values."""


DERIVED_KEY = "megatron"  # the read-only block Plan.to_json writes and Plan.from_json ignores


LINK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"bandwidth": {"type": "number"}, "latency_s": {"type": "number"}},
    "required": ["bandwidth", "latency_s"],
    "additionalProperties": False,
}
CLUSTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "The cluster the plan was made for, as a cluster file holds it (cost_models.cluster).",
    "properties": {
        "name": {"type": "string"},
        "num_nodes": {"type": "integer"},
        "devices_per_node": {"type": "integer"},
        "device": {"type": "object"},
        "intra_node": LINK_SCHEMA,
        "inter_node": LINK_SCHEMA,
        "nics_per_node": {"type": "integer"},
        "calibration": {"type": "object"},
    },
    "required": ["name", "num_nodes", "devices_per_node", "device", "intra_node", "inter_node"],
    "additionalProperties": False,
}
# The plan's codec: every class of the plan by introspection, the cluster as its own file format writes it.
PLAN_CODEC = Codec(
    external={
        Cluster: External(
            encode=Cluster.to_json, decode=lambda data: Cluster.from_json(data, source="plan"), schema=CLUSTER_SCHEMA
        )
    }
)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel plan: the model and cluster it was made for, its stages, its estimate and how it was found."""

    format_version: int = FORMAT_VERSION  # first in the file: what a reader checks before anything else
    method: Method  # a str naming a member is taken too (__post_init__)
    model: ModelRef
    cluster: Cluster
    batch_size: int
    num_microbatches: int
    schedule: Schedule  # a str naming a member is taken too (__post_init__)
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
    # what the model file's loss holds at its peak per element of the outputs it reads, as the search priced it
    # (cost_models.loss_memory; 4.0: its DEFAULT_BYTES_PER_OUTPUT_ELEMENT, the mean's float32 gradient): the
    # simulator and ``plan show`` price the plan's memory with it too (planner.costing.setup.plan_setup)
    loss_bytes_per_output_element: float = 4.0
    # the model's outputs hold the batch in dim 0 (two captures showed it): a sharded last stage runs the loss on
    # each rank's rows of them (planner.plan.stage.loss_row_axes); False: on the whole outputs, gathered on each device
    outputs_batch_major: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.method, Method):
            if self.method not in set(Method):
                raise PlanError(f"method {self.method!r} is not one of {', '.join(Method)}")
            object.__setattr__(self, "method", Method(self.method))  # frozen
        if not isinstance(self.schedule, Schedule):
            if self.schedule not in SCHEDULES:
                raise PlanError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
            object.__setattr__(self, "schedule", Schedule(self.schedule))  # frozen

    @property
    def num_devices(self) -> int:
        return len({device for stage in self.stages for device in stage.devices})

    @property
    def zero(self) -> int:
        """The highest ZeRO level of the stages (each stage has its own: ``Stage.zero``)."""
        return max((stage.zero for stage in self.stages), default=0)

    @property
    def is_pure_data_parallel(self) -> bool:
        """One stage on several devices, every parameter replicated (:attr:`Stage.is_pure_data_parallel`): the
        executors run it with DDP, or with FSDP at a ZeRO level above 0."""
        return len(self.stages) == 1 and self.stages[0].is_pure_data_parallel

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

    @property
    def megatron(self) -> MegatronTerms:
        """The plan in Megatron-LM's terms (global batch, micro-batch size per replica, TP/PP/DP/VPP, tokens/s per
        GPU, MFU), derived from the plan (:mod:`planner.plan.megatron_terms`)."""
        return megatron_terms(
            PlanFigures(
                batch_size=self.batch_size,
                num_microbatches=self.num_microbatches,
                schedule=self.schedule,
                stages=self.stages,
                num_devices=self.num_devices,
                num_pipeline_ranks=self.num_pipeline_ranks,
                virtual_stages=self.virtual_stages,
                sequence_length=self.model.sequence_length,
                step_time_s=self.estimate.step_time_s,
                mfu=self.estimate.mfu,
            )
        )

    def summary(self, *, plan_path: str | None = None) -> str:
        """The summary ``plan`` prints (:func:`planner.plan.report.plan_summary`); ``plan_path``: where the plan is
        saved, for the next-step lines (default ``PLAN.json``)."""
        return plan_summary(self, plan_path=plan_path)

    def __str__(self) -> str:
        """``print(plan)`` prints its summary (the dataclass ``repr`` stays the field-by-field one)."""
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data (:data:`PLAN_CODEC`), with its derived ``megatron`` block last."""
        return {**PLAN_CODEC.encode(self), DERIVED_KEY: PLAN_CODEC.encode(self.megatron)}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """The plan ``data`` holds; :class:`PlanError` in one line for another format version or malformed data."""
        version = data.get("format_version") if isinstance(data, Mapping) else None
        if version != FORMAT_VERSION:
            raise PlanError(
                f"plan format_version {version!r} is not one this autoplan reads ({FORMAT_VERSION}): "
                "re-plan the model with `plan MODEL_FILE ...` to get a plan it can run"
            )
        stored = {key: value for key, value in data.items() if key != DERIVED_KEY}  # derived: recomputed, not read
        try:
            return PLAN_CODEC.decode(cls, stored)
        except (CodecError, TypeError, ValueError) as error:
            raise PlanError(f"plan JSON is malformed: {error}") from None


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
