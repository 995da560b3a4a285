"""A plan stage: its nodes, devices and mesh, every parameter's placement, and every node's strategy.

The strategy a stage stores for a node (:class:`NodeSharding`) is the program the executors run and
the simulator prices: the spec each operand is consumed in, the output spec, the compute split and
the collectives (:class:`Collective`) it issues, each naming the operand it moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
PHASES = ("forward", "backward", "sync")  # per microbatch, per microbatch, once per step


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
    explanation: tuple[Mapping[str, Any], ...] = ()  # per node: split, spec and seconds (planner.intra.to_stage)

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
