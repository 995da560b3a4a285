"""A plan stage: its nodes, devices and mesh, every parameter's placement, and every node's strategy.

The strategy a stage stores for a node (:class:`NodeSharding`) is the program the executors run and
the simulator prices: the spec each operand is consumed in, the output spec, the compute split and
the collectives (:class:`Collective`) it issues, each naming the operand it moves.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
PHASES = ("forward", "backward", "sync")  # per microbatch, per microbatch, once per step
GATHERED = "R*"  # a placement: replicated, its gradient handed back as partial sums (sequence parallelism's g)
ZERO_LEVELS = (0, 1, 2, 3)  # cost_models.memory: what each level shards over the data-parallel axes


class Remat(enum.StrEnum):
    """What a stage recomputes in backward instead of keeping from forward (its ``remat_regions``):

    * ``none`` — nothing;
    * ``attention`` — each attention core (``Q·Kᵀ``, mask, softmax, dropout, ``·V``; Korthikanti et al. 2022 §5);
    * ``full`` — each layer, keeping only its inputs (Megatron's full recomputation, one layer per checkpoint).

    ``bool(remat)`` says whether the stage recomputes anything (plans stored ``remat: true/false``)."""

    NONE = "none"
    ATTENTION = "attention"
    FULL = "full"

    def __bool__(self) -> bool:
        return self is not Remat.NONE


def memory_choice_label(remat: Remat | str, zero: int) -> str:
    """``selective recomputation, ZeRO-1``; ``no recomputation, no ZeRO``."""
    kind = {
        "none": "no recomputation",
        "attention": "selective recomputation (attention)",
        "full": "full recomputation",
    }[str(as_remat(remat))]
    return f"{kind}, {f'ZeRO-{zero}' if zero else 'no ZeRO'}"


def as_remat(value: Remat | str | bool) -> Remat:
    """``true`` (older plans: the whole stage) is ``full``, ``false`` is ``none``."""
    if isinstance(value, bool):
        return Remat.FULL if value else Remat.NONE
    return Remat(value)


@dataclass(frozen=True, kw_only=True)
class Collective:
    """A collective a node issues: ``kind`` over mesh ``axis`` in ``phase`` on ``operand`` (the position
    of one of the node's inputs; None: its output). ``forward``: the all-reduce of a partial sum;
    ``backward``: the all-reduce of a replicated input's gradient; ``sync``: a parameter's gradient
    all-reduce, once per step. Under sequence parallelism a partial sum is reduce-scattered forward and
    its gradient all-gathered backward, or an output computed on sequence shards is all-gathered
    forward (``R*``) and its gradient reduce-scattered backward (:attr:`is_sequence_parallel`)."""

    kind: str
    axis: int
    phase: str
    operand: int | None = None

    @property
    def is_sequence_parallel(self) -> bool:
        """Megatron sequence parallelism's forward collectives on a node's output: a partial sum reduce-scattered
        along the sequence (``ḡ``), or an output computed on sequence shards gathered for its readers (``g``)."""
        return self.phase == "forward" and self.operand is None and self.kind in ("reduce_scatter", "all_gather")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "phase": self.phase, "operand": self.operand}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Collective:
        operand = data.get("operand")
        return cls(
            kind=str(data["kind"]),
            axis=int(data["axis"]),
            phase=str(data["phase"]),
            operand=None if operand is None else int(operand),
        )


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
    remat: Remat = Remat.NONE  # what backward recomputes: the runs of nodes in ``remat_regions``
    # checkpointed runs of consecutive stage nodes, (first, last) each, in stage order; empty with remat: the whole stage
    remat_regions: tuple[tuple[str, str], ...] = ()
    zero: int = 0  # ZeRO level over the stage's data-parallel axes (ZERO_LEVELS; cost_models.memory)
    # what the recomputation and ZeRO level save against the next-best pair: {choice, next_best, saved_s, saved_bytes}
    memory_saving: Mapping[str, Any] = field(default_factory=dict)
    # what Megatron sequence parallelism saves against the stage without it, the same keys (planner.inter.sp_saving)
    sequence_parallel_saving: Mapping[str, Any] = field(default_factory=dict)
    explanation: tuple[Mapping[str, Any], ...] = ()  # per node: split, spec and seconds (planner.intra.to_stage)

    def __post_init__(self) -> None:
        object.__setattr__(self, "remat", as_remat(self.remat))  # a bool or a name, as older callers pass it
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
    def uses_sequence_parallelism(self) -> bool:
        """Some node of the stage scatters or gathers along the sequence (:attr:`Collective.is_sequence_parallel`)."""
        return any(c.is_sequence_parallel for record in self.strategies.values() for c in record.collectives)

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
            "remat": str(self.remat),
            "remat_regions": [list(region) for region in self.remat_regions],
            "zero": self.zero,
            "memory_saving": dict(self.memory_saving),
            "sequence_parallel_saving": dict(self.sequence_parallel_saving),
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
            remat=as_remat(data.get("remat", False)),
            remat_regions=tuple(tuple(region) for region in data.get("remat_regions", ())),
            zero=int(data.get("zero", 0)),
            memory_saving=dict(data.get("memory_saving", {})),
            sequence_parallel_saving=dict(data.get("sequence_parallel_saving", {})),
            explanation=tuple(dict(row) for row in data.get("explanation", ())),
        )
