"""The immutable intermediate representation every planner works on.

An :class:`OpGraph` is a captured training forward pass: its nodes are operators in
topological order, each with the shapes and dtypes of what it reads and writes, the
parameters it uses (fully qualified names from ``named_parameters()``), its forward and
backward FLOPs, the bytes it moves and the module it came from. Values are named: a node's
output is named after the node, a graph input after its placeholder, a parameter by its
fully qualified name. Nothing here holds a tensor, so a graph of a 39B-parameter model is a
few megabytes: a constant that ``torch.export`` lifted out of the forward (``torch.tensor([-2])`` in
Falcon's attention) is a buffer whose values the graph keeps as numbers (:class:`GraphConstant`), so that
every rank can hand it to its stages. The model's output keeps its structure (a dict, a Hugging Face
``ModelOutput``, a tuple): :class:`OutputTree` rebuilds it from the graph's output values
(:meth:`OutputTree.rebuild`).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import networkx as nx

if TYPE_CHECKING:  # a plan loads without torch (tests/test_plan_schema.py): torch only where an output is rebuilt
    from torch.utils._pytree import TreeSpec


class NodeKind(enum.StrEnum):
    """What an operator does, as far as parallelization cares."""

    MATMUL = "matmul"
    EMBEDDING = "embedding"
    NORM = "norm"
    SOFTMAX = "softmax"
    ATTENTION = "attention"
    CONV = "conv"
    POOL = "pool"
    ELEMENTWISE = "elementwise"
    VIEW = "view"
    REDUCTION = "reduction"
    INDEX = "index"
    CREATION = "creation"
    OTHER = "other"


class ValueKind(enum.StrEnum):
    INPUT = "input"
    PARAM = "param"
    BUFFER = "buffer"
    NODE = "node"


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor (dtype as torch names it, without ``torch.``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_floating(self) -> bool:
        return self.dtype in _FLOATING

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}
_FLOATING = {"float64", "float32", "float16", "bfloat16"}


@dataclass(frozen=True, slots=True)
class TensorArg:
    """Stands in an operator's argument structure for its ``index``-th tensor input."""

    index: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphValue:
    """A graph input, parameter or buffer: a named tensor that no node produces."""

    name: str
    kind: ValueKind
    meta: TensorMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphConstant:
    """A tensor the forward makes from constants (``torch.tensor([-2])``), which ``torch.export`` lifts out as
    an input of the graph: named like a buffer (``…self_attention.lifted_tensor_0``) but no attribute of the
    model, so its values travel with the graph (flattened, in row-major order)."""

    name: str
    meta: TensorMeta
    values: tuple[Any, ...]


@dataclass(frozen=True, kw_only=True)
class OutputTree:
    """How the model's output is made of graph values: ``spec`` (a ``torch.utils._pytree`` spec: a tensor, a
    tuple, a dict, a ``ModelOutput``) over ``leaves``, each the name of a graph value or ``constants[i]``'s
    value where ``leaves[i]`` is None (a ``None`` or a number in the output)."""

    spec: TreeSpec
    leaves: tuple[str | None, ...]
    constants: tuple[Any, ...]

    def rebuild(self, values: Mapping[str, Any]) -> Any:
        """The output as the model returns it, from the values of the graph's outputs by name."""
        from torch.utils._pytree import tree_unflatten

        flat = [
            values[leaf] if leaf is not None else constant
            for leaf, constant in zip(self.leaves, self.constants, strict=True)
        ]
        return tree_unflatten(flat, self.spec)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpNode:
    """One operator of the captured forward pass.

    ``inputs`` names the values the operator reads, in the order ``TensorArg`` indices refer
    to; ``args`` and ``kwargs`` keep the operator's full call with tensors replaced by
    ``TensorArg``. ``outputs`` has one entry per tensor the operator returns.
    """

    name: str
    target: str
    kind: NodeKind
    inputs: tuple[str, ...]
    input_metas: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    params: tuple[str, ...] = ()
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    flops_fwd: int = 0
    flops_bwd: int = 0
    bytes_moved: int = 0
    module_path: str = ""

    @property
    def output(self) -> TensorMeta:
        return self.outputs[0]

    @property
    def op_name(self) -> str:
        """The operator's short name: ``linear`` for ``aten.linear.default``."""
        return op_base_name(self.target)

    def signature(self) -> str:
        """What determines this node's cost: the same signature means the same time."""
        metas = ",".join(f"{m.dtype}{list(m.shape)}" for m in self.input_metas)
        return f"{self.target}({metas};{self.args!r};{self.kwargs!r})"


def op_base_name(target: str) -> str:
    """``aten.linear.default`` -> ``linear``; ``torch.nn.functional.gelu`` -> ``gelu``."""
    parts = target.split(".")
    if parts[0] == "aten" and len(parts) >= 2:
        return parts[1]
    return parts[-1]


@dataclass(frozen=True, kw_only=True)
class OpGraph:
    """Nodes in topological order plus the values that enter the graph from outside."""

    nodes: tuple[OpNode, ...]
    inputs: tuple[GraphValue, ...]
    params: tuple[GraphValue, ...]
    buffers: tuple[GraphValue, ...] = ()
    outputs: tuple[str, ...] = ()
    constants: tuple[GraphConstant, ...] = ()  # the buffers that are lifted constants, with their values
    # the output's structure; kept by the process that captured it (not pickled: its types may live in a model file)
    output_tree: OutputTree | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        assert len(self._index) == len(self.nodes), "node names must be unique"
        seen = set(self._values)
        for node in self.nodes:
            missing = [name for name in node.inputs if name not in seen]
            assert not missing, f"{node.name} reads {missing} before they exist"
            seen.add(node.name)

    def __getstate__(self) -> dict[str, object]:
        """The fields only (the cached indexes are rebuilt on use): a graph crosses processes pickled."""
        names = {f.name for f in fields(self)} - {"output_tree"}
        return {key: value for key, value in self.__dict__.items() if key in names}

    @cached_property
    def _index(self) -> Mapping[str, OpNode]:
        return MappingProxyType({node.name: node for node in self.nodes})

    @cached_property
    def _values(self) -> Mapping[str, GraphValue]:
        return MappingProxyType({v.name: v for v in (*self.inputs, *self.params, *self.buffers)})

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, name: str) -> OpNode:
        return self._index[name]

    def has_node(self, name: str) -> bool:
        return name in self._index

    def value(self, name: str) -> GraphValue:
        return self._values[name]

    def value_kind(self, name: str) -> ValueKind:
        if name in self._index:
            return ValueKind.NODE
        return self._values[name].kind

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def num_params(self) -> int:
        return sum(p.meta.numel for p in self.params)

    @property
    def flops_fwd(self) -> int:
        return sum(node.flops_fwd for node in self.nodes)

    @property
    def flops_bwd(self) -> int:
        return sum(node.flops_bwd for node in self.nodes)

    def consumers(self) -> dict[str, list[str]]:
        """Value name -> names of the nodes that read it."""
        readers: dict[str, list[str]] = {}
        for node in self.nodes:
            for name in dict.fromkeys(node.inputs):
                readers.setdefault(name, []).append(node.name)
        return readers

    def to_networkx(self) -> nx.DiGraph:
        """Nodes are operators (with the OpNode under ``"op"``); edges carry ``bytes``."""
        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.name, op=node)
            for name, meta in zip(node.inputs, node.input_metas, strict=True):
                if name in self._index:
                    previous = graph.edges[name, node.name]["bytes"] if graph.has_edge(name, node.name) else 0
                    graph.add_edge(name, node.name, bytes=max(previous, meta.nbytes))
        return graph

    def fingerprint(self) -> str:
        """A short hash of the structure: targets, shapes, wiring and parameter shapes."""
        digest = hashlib.sha256()
        for value in (*self.inputs, *self.params, *self.buffers):
            digest.update(f"{value.kind}:{value.name}:{value.meta}\n".encode())
        for node in self.nodes:
            digest.update(f"{node.name}={node.signature()}<-{node.inputs}\n".encode())
        digest.update(repr(self.outputs).encode())
        return digest.hexdigest()[:16]


def subgraph(graph: OpGraph, names: list[str]) -> OpGraph:
    """The nodes ``names`` as a graph of their own; values from outside become its inputs."""
    inside = set(names)
    nodes = [graph.node(name) for name in names]
    inputs: dict[str, GraphValue] = {}
    params: dict[str, GraphValue] = {}
    buffers: dict[str, GraphValue] = {}
    for node in nodes:
        for name, meta in zip(node.inputs, node.input_metas, strict=True):
            if name in inside:
                continue
            kind = graph.value_kind(name)
            if kind == ValueKind.PARAM:
                params[name] = graph.value(name)
            elif kind == ValueKind.BUFFER:
                buffers[name] = graph.value(name)
            else:
                inputs.setdefault(name, GraphValue(name=name, kind=ValueKind.INPUT, meta=meta))
    readers_outside = {name for node in graph.nodes if node.name not in inside for name in node.inputs}
    outputs = tuple(n for n in names if n in readers_outside or n in graph.outputs)
    return OpGraph(
        nodes=tuple(nodes),
        inputs=tuple(inputs.values()),
        params=tuple(params.values()),
        buffers=tuple(buffers.values()),
        outputs=outputs,
    )


def node_difference(reference: OpGraph, other: OpGraph) -> str | None:
    """How ``other`` (the model at another batch) differs from ``reference`` in its operators, their order and
    targets, in words; None when it has the same ones (what the executors need to run a plan's operators there)."""
    names = [(n.name, n.target) for n in reference.nodes]
    others = [(n.name, n.target) for n in other.nodes]
    if names == others:
        return None
    first = next(((a, b) for a, b in zip(names, others, strict=False) if a != b), None)
    where = f", first difference {first[0][0]} ({first[0][1]}) against {first[1][0]} ({first[1][1]})" if first else ""
    return f"{len(others)} against {len(names)} operators{where}"
