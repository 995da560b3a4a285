"""A plan stage: its nodes, devices and mesh, every parameter's placement, every node's strategy, and what its
choices saved.

The strategy a stage stores for a node (:class:`NodeSharding`) is the program the executors run and
the simulator prices: the spec each operand is consumed in, the output spec, the compute split and
the collectives (:class:`Collective`) it issues, each naming the operand it moves. A stage explains itself
with a row per node (:class:`~planner.plan.explain.ExplainRow`) and what its recomputation and ZeRO level
(:class:`MemorySaving`) and its sequence parallelism (:class:`Saving`) saved against the next-best option.

*The loss on each rank's rows* (:func:`loss_row_axes`). A stage of several devices computes with DTensor; its
model outputs come out split as its operators' strategies leave them. Were they gathered whole on every rank,
each device of the last stage would hold the logits of the whole microbatch and the loss's tensors on them
(Llama-3-405B at 64 rows: 877 GiB). When the model's outputs are batch-major (dim 0 holds ``k`` entries per
batch row, as two captures prove: :meth:`planner.ir.rebatch.MicrobatchGraphs.outputs_batch_major`;
``Plan.outputs_batch_major``), the runner instead splits the outputs by rows over the mesh axes
:func:`loss_row_axes` picks and replicates them over the rest
(:meth:`executors.parallel.tensor_parallel.StageSharding.leave_rows`); each rank runs the loss on its rows (and
on its rows of the loss's batched inputs: those of dim 0 = the microbatch's rows, as microbatches are cut),
scaled by ``1/n``, ``n`` the product of those axes' sizes; the loss of the step is the sum over them.

That is the whole microbatch's loss and gradient when the loss is a mean over rows — the executors' assumption
for microbatches and data-parallel replicas already (:func:`executors.parity.likely_cause` names a loss that is
not). The memory model charges the outputs and the loss at ``1/n`` of their whole size
(:mod:`planner.costing.plan_memory`, :func:`planner.inter.layer_costs.loss_and_output_bytes`).

*Shards across stage boundaries* (:func:`boundary_spec`). Between two stages of a pipeline whose stages all have
the same number of devices, rank ``i`` of a stage sends to rank ``i`` of the next (a pipeline group). When the two
stages' meshes have the same shape (:func:`sends_shards`), a value the sending stage computed crosses as the shards
its output spec leaves it in (each ``S(d)`` kept where the axes divide dim ``d`` evenly, the rest replicated) — the
shard rank ``i`` holds is the one rank ``i`` of the next stage holds at the same mesh coordinates — instead of
whole on every rank: no gather before the send, ``1/n`` of the bytes on the wire and in the buffers both stages
keep for the backward. Any other value (a graph input, one passing through a stage, a boundary between meshes of
different shapes) crosses whole, as before. Exact by construction: the receiver reads the same tensor, a DTensor
in that spec (:meth:`executors.parallel.tensor_parallel.StageSharding.enter_shards`), which its first reader
redistributes to the spec it reads.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from planner.ir.graph import OpNode
from planner.plan.codec import JsonCoded
from planner.plan.explain import ExplainRow

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
Phase = Literal["forward", "backward", "sync"]  # per microbatch, per microbatch, once per step
COLLECTIVE_KINDS: tuple[str, ...] = get_args(CollectiveKind)
PHASES: tuple[str, ...] = get_args(Phase)
GATHERED = "R*"  # a placement: replicated, its gradient handed back as partial sums (sequence parallelism's g)
ZERO_LEVELS = (0, 1, 2, 3)  # cost_models.memory: what each level shards over the data-parallel axes


class Remat(enum.StrEnum):
    """What a stage recomputes in backward instead of keeping from forward (its ``remat_regions``):

    * ``none`` — nothing;
    * ``attention`` — each attention core (``Q·Kᵀ``, mask, softmax, dropout, ``·V``; Korthikanti et al. 2022 §5);
    * ``full`` — each layer, keeping only its inputs (Megatron's full recomputation, one layer per checkpoint).

    ``bool(remat)`` says whether the stage recomputes anything."""

    NONE = "none"
    ATTENTION = "attention"
    FULL = "full"

    def __bool__(self) -> bool:
        return self is not Remat.NONE


def memory_choice_label(remat: Remat | str, zero: int, *, offload: bool = False) -> str:
    """``selective recomputation, ZeRO-1``; ``no recomputation, no ZeRO``; ``…, ZeRO-3, CPU offload``."""
    kind = {
        "none": "no recomputation",
        "attention": "selective recomputation (attention)",
        "full": "full recomputation",
    }[str(as_remat(remat))]
    return f"{kind}, {f'ZeRO-{zero}' if zero else 'no ZeRO'}" + (", CPU offload" if offload else "")


def as_remat(value: Remat | str | bool) -> Remat:
    """A name, or a bool: ``True`` (the whole stage) is ``full``, ``False`` is ``none``."""
    if isinstance(value, bool):
        return Remat.FULL if value else Remat.NONE
    return Remat(value)


@dataclass(frozen=True, kw_only=True)
class Collective(JsonCoded):
    """A collective a node issues: ``kind`` over mesh ``axis`` in ``phase`` on ``operand`` (the position
    of one of the node's inputs; None: its output).

    ``forward``: the all-reduce of a partial sum; ``backward``: the all-reduce of a replicated input's gradient;
    ``sync``: a parameter's gradient all-reduce, once per step. Under sequence parallelism a partial sum is
    reduce-scattered forward and its gradient all-gathered backward, or an output computed on sequence shards is
    all-gathered forward (``R*``) and its gradient reduce-scattered backward (:attr:`is_sequence_parallel`)."""

    kind: CollectiveKind
    axis: int
    phase: Phase
    operand: int | None = None

    @property
    def is_sequence_parallel(self) -> bool:
        """Megatron sequence parallelism's forward collectives on a node's output: a partial sum reduce-scattered
        along the sequence (``ḡ``), or an output computed on sequence shards gathered for its readers (``g``)."""
        return self.phase == "forward" and self.operand is None and self.kind in ("reduce_scatter", "all_gather")


@dataclass(frozen=True, kw_only=True)
class NodeSharding(JsonCoded):
    """The strategy the search chose for one node, as the executors run it and the simulator prices it.

    ``input_specs`` has one entry per node input: the spec an activation is redistributed to before
    the node runs, the spec a parameter is held in, or None for a buffer or an argument read only
    for its shape. ``split`` names what each mesh axis splits (the strategy's name)."""

    split: str
    input_specs: tuple[tuple[str, ...] | None, ...]
    output_spec: tuple[str, ...]
    compute_shards: int = 1
    collectives: tuple[Collective, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Saving(JsonCoded):
    """What a stage's choice saved against the next-best option: seconds per step and bytes per device, positive
    when the choice is the cheaper (:mod:`planner.plan.choices` reads them)."""

    choice: str
    next_best: str  # ends " (does not fit)" when the next best is over the memory budget
    saved_s: float
    saved_bytes: float


@dataclass(frozen=True, kw_only=True)
class MemorySaving(Saving):
    """What a stage's recomputation and ZeRO level saved against the next-best pair (``next_best_remat`` and
    ``next_best_zero``): :meth:`planner.inter.stage_shapes.StageTemplate.memory_saving`,
    :func:`planner.inter.data_parallel_levels.best_level`."""

    next_best_remat: Remat
    next_best_zero: int


@dataclass(frozen=True, kw_only=True)
class Stage(JsonCoded):
    """One pipeline stage: its nodes on its devices' mesh (a later virtual stage on the devices of stage
    ``index mod P``), every parameter's placement and every node's strategy, and what its choices saved."""

    index: int
    nodes: tuple[str, ...]
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    strategies: Mapping[str, NodeSharding] = field(default_factory=dict)  # every node's, by name
    param_placements: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    remat: Remat = Remat.NONE  # what backward recomputes: the runs of nodes in ``remat_regions``
    # checkpointed runs of consecutive stage nodes, (first, last) each, in stage order;
    # empty with remat: the whole stage
    remat_regions: tuple[tuple[str, str], ...] = ()
    zero: int = 0  # ZeRO level over the stage's data-parallel axes (ZERO_LEVELS; cost_models.memory)
    # FSDP2's CPUOffloadPolicy (zero >= 1, a data-parallel plan): the shards of the parameters, gradients and
    # optimizer state live in host memory and the optimizer steps on the CPU (planner.costing.offload)
    offload: bool = False
    # what the recomputation and ZeRO level save against the next-best pair (None: no other pair to compare)
    memory_saving: MemorySaving | None = None
    # what Megatron sequence parallelism saves against the stage without it (planner.inter.sp_saving; None: unused)
    sequence_parallel_saving: Saving | None = None
    explanation: tuple[ExplainRow, ...] = ()  # per node: split, spec and seconds (planner.costing.stage_work)

    def __post_init__(self) -> None:
        object.__setattr__(self, "remat", as_remat(self.remat))  # a bool or a name, as callers pass it
        object.__setattr__(self, "remat_regions", tuple((str(a), str(b)) for a, b in self.remat_regions))

    def recomputed_runs(self) -> tuple[tuple[str, ...], ...]:
        """The node names of each checkpointed run, in stage order (none without recomputation)."""
        if not self.remat:
            return ()
        if not self.remat_regions:
            return (tuple(self.nodes),)
        position = {name: index for index, name in enumerate(self.nodes)}
        return tuple(self.nodes[position[first] : position[last] + 1] for first, last in self.remat_regions)

    @property
    def is_pure_data_parallel(self) -> bool:
        """Several devices, every parameter replicated: each device runs the whole stage on its share of the batch
        (a one-stage plan of such a stage runs as DDP, or FSDP at a ZeRO level: :attr:`Plan.is_pure_data_parallel`)."""
        return len(self.devices) > 1 and all(set(spec) == {"R"} for spec in self.param_placements.values())

    @property
    def uses_sequence_parallelism(self) -> bool:
        """Some node of the stage scatters or gathers along the sequence (:attr:`Collective.is_sequence_parallel`)."""
        return any(c.is_sequence_parallel for record in self.strategies.values() for c in record.collectives)

    @property
    def output_specs(self) -> dict[str, tuple[str, ...]]:
        """Node name -> its output spec (from its strategy)."""
        return {name: record.output_spec for name, record in self.strategies.items()}


@dataclass(frozen=True, kw_only=True)
class StageDegrees:
    tensor: int
    data: int

    def text(self) -> str:
        """``tensor 4 × data 2``; ``1 device`` when both are 1."""
        parts = [f"{name} {size}" for name, size in (("tensor", self.tensor), ("data", self.data)) if size > 1]
        return " × ".join(parts) or "1 device"


def axis_roles(stage: Stage) -> tuple[str, ...]:
    """Per mesh axis of ``stage``: ``"tensor"`` when parameters are sharded along it and at least as many
    as have their gradients synced over it, else ``"data"``."""
    return tuple(_axis_role(stage, axis) for axis in range(len(stage.mesh_shape)))


def _axis_role(stage: Stage, axis: int) -> str:
    sharded = sum(spec[axis].startswith("S") for spec in stage.param_placements.values())
    synced = sum(
        collective.phase == "sync" and collective.axis == axis
        for record in stage.strategies.values()
        for collective in record.collectives
    )
    return "tensor" if sharded and sharded >= synced else "data"


def stage_degrees(stage: Stage) -> StageDegrees:
    """The stage's tensor and data degrees: products of the sizes of its tensor and data mesh axes."""
    tensor = data = 1
    for size, role in zip(stage.mesh_shape, axis_roles(stage), strict=True):
        if role == "tensor":
            tensor *= size
        else:
            data *= size
    return StageDegrees(tensor=tensor, data=data)


def loss_row_axes(mesh_shape: Sequence[int], *, rows: int) -> tuple[int, ...]:
    """The mesh axes the last stage splits its outputs' rows over: of the axes of more than one device, the set
    with the largest product that divides ``rows`` (the microbatch's rows), the earlier axes on a tie."""
    candidates = [axis for axis, size in enumerate(mesh_shape) if size > 1]
    best: tuple[int, ...] = ()
    for count in range(len(candidates), 0, -1):
        for axes in itertools.combinations(candidates, count):
            split = math.prod(mesh_shape[axis] for axis in axes)
            if rows % split == 0 and split > math.prod(mesh_shape[axis] for axis in best):
                best = axes
    return best


def loss_row_split(mesh_shape: Sequence[int], *, rows: int) -> int:
    """How many pieces the last stage cuts its outputs' rows into (1: whole on every rank)."""
    return math.prod(mesh_shape[axis] for axis in loss_row_axes(mesh_shape, rows=rows))


def sends_shards(mesh_shapes: Sequence[Sequence[int]], index: int) -> bool:
    """Whether stage ``index`` of a pipeline whose stages have ``mesh_shapes`` sends the values it computes to the
    next stage as their shards (:func:`boundary_spec`): every stage has the same number of devices (one pipeline
    group per device position), more than one, and the next stage's mesh has this one's shape."""
    if index + 1 >= len(mesh_shapes) or len({math.prod(shape) for shape in mesh_shapes}) != 1:
        return False
    return math.prod(mesh_shapes[index]) > 1 and tuple(mesh_shapes[index]) == tuple(mesh_shapes[index + 1])


def boundary_spec(output_spec: Sequence[str], *, mesh_shape: Sequence[int], shape: Sequence[int]) -> tuple[str, ...]:
    """The spec a value crosses a stage boundary in, from its producer's ``output_spec`` and its ``shape``: each axis
    of more than one device keeps the dim its output spec splits (``S(d)``), where the axes splitting that dim divide
    it evenly; the rest is replicated (``R``). All ``R``: it crosses whole."""
    kept = [
        placement if placement.startswith("S(") and mesh_shape[axis] > 1 else "R"
        for axis, placement in enumerate(output_spec)
    ]
    for dim in {placement for placement in kept if placement != "R"}:
        axes = [axis for axis, placement in enumerate(kept) if placement == dim]
        size = shape[int(dim[2:-1])] if int(dim[2:-1]) < len(shape) else 0
        if not size or size % math.prod(mesh_shape[axis] for axis in axes):
            kept = ["R" if placement == dim else placement for placement in kept]
    return tuple(kept)


def sent_spec(node: OpNode, output_spec: Sequence[str], *, mesh_shape: Sequence[int]) -> tuple[str, ...] | None:
    """The spec the value ``node`` computes crosses to the next stage in when its stage sends shards
    (:func:`sends_shards`): :func:`boundary_spec` of its ``output_spec``, for a node of one output with a shape;
    None when it crosses whole. The one rule the runner (``executors.parallel.pipeline.boundary_shards``) and the
    memory model (``planner.costing.plan_memory``) share."""
    if len(node.outputs) != 1 or not node.output.shape:
        return None
    spec = boundary_spec(output_spec, mesh_shape=mesh_shape, shape=node.output.shape)
    return spec if any(placement != "R" for placement in spec) else None
