"""Run part of a captured :class:`~planner.ir.graph.OpGraph` as an ``nn.Module``.

The plan names graph nodes, so executors run the graph the plan was made for, not the user's
``forward``: :class:`GraphModule` interprets a :class:`Segment` — some nodes of the graph, the
values it reads from outside (graph inputs, or values computed by another stage) and the values it
hands on — calling each node's operator again with :func:`planner.ir.node_call.resolve_target` and
:func:`planner.ir.node_call.bind_call`. Parameters and buffers are taken by name from the real model,
so a segment's gradients are the model's gradients by name.

A ``call_node`` hook lets tensor parallelism run each node on DTensors
(:mod:`executors.tensor_parallel`); the default runs it on plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.ir.graph import OpGraph, OpNode, TensorArg
from planner.ir.node_call import bind_call, resolve_target

NodeCaller = Callable[[OpNode, list[Any]], Any]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Nodes run in order; ``inputs`` come in as ``forward``'s arguments, ``outputs`` go out."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]
    buffers: tuple[str, ...]


def make_segment(graph: OpGraph, nodes: Iterable[str], *, needed_after: Iterable[str]) -> Segment:
    """The segment of ``nodes`` (in graph order): it reads what they use and nobody in it made, and
    hands on every value in ``needed_after`` that it made or received."""
    chosen = set(nodes)
    ordered = tuple(node.name for node in graph.nodes if node.name in chosen)
    params, buffers = set(graph.param_names), {b.name for b in graph.buffers}
    made: set[str] = set()
    inputs: list[str] = []
    used_params: list[str] = []
    used_buffers: list[str] = []
    for name in ordered:
        for value in graph.node(name).inputs:
            if value in params:
                used_params.append(value)
            elif value in buffers:
                used_buffers.append(value)
            elif value not in made:
                inputs.append(value)
                made.add(value)
        made.add(name)
    later = list(dict.fromkeys(needed_after))
    missing = [value for value in later if value not in made and value not in graph.param_names]
    inputs.extend(missing)  # values passed through this segment to a later one
    return Segment(
        nodes=ordered,
        inputs=tuple(dict.fromkeys(inputs)),
        outputs=tuple(value for value in later if value not in graph.param_names),
        params=tuple(dict.fromkeys(used_params)),
        buffers=tuple(dict.fromkeys(used_buffers)),
    )


def _functional_copy(target: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy`` (what functionalization makes of ``x[i] = y``) has no autograd formula: the same
    values — ``source`` in ``target``'s shape and dtype — differentiably."""
    return source.to(target.dtype).expand(target.shape).clone()


# Captured on contiguous tensors, a reshape is recorded as a view; here its input may be laid out
# otherwise (an LSTM's output, a redistributed shard), so it runs as a reshape: the same values, a copy
# only where a view is impossible. A functional copy runs as its differentiable equivalent.
RUN_AS: dict[str, Callable[..., Any]] = {
    "aten.view.default": torch.ops.aten.reshape.default,
    "aten._unsafe_view.default": torch.ops.aten.reshape.default,
    "aten.copy.default": _functional_copy,
}


def run_target(node: OpNode) -> Callable[..., Any]:
    """The callable that runs ``node`` here (its own operator, or the equivalent in :data:`RUN_AS`)."""
    return RUN_AS.get(node.target) or resolve_target(node.target)


def call_node_plain(node: OpNode, tensors: list[Any], *, device: str = "cpu") -> Any:
    """Run one node's operator on ``tensors`` (its inputs in ``node.inputs`` order)."""
    args, kwargs = bind_call(node.args, node.kwargs, tensors, device=device)
    return run_target(node)(*args, **kwargs)


def compile_node(node: OpNode, *, device: str = "cpu") -> Callable[[list[Any]], Any]:
    """:func:`call_node_plain` for ``node`` with the call's structure worked out once.

    When every tensor stands at the top level of the arguments and nothing names a device, a call
    only drops the tensors into their slots (about 1 µs); otherwise it goes through ``bind_call``.
    """
    function = run_target(node)
    args, kwargs = list(node.args), dict(node.kwargs)
    if _nested(args, top=True) or _nested(list(kwargs.values()), top=True) or "device" in kwargs:
        return lambda tensors: call_node_plain(node, tensors, device=device)
    slots = [(i, a.index) for i, a in enumerate(args) if isinstance(a, TensorArg)]
    keyword_slots = [(k, v.index) for k, v in kwargs.items() if isinstance(v, TensorArg)]

    def call(tensors: list[Any]) -> Any:
        bound = args.copy()
        for position, index in slots:
            bound[position] = tensors[index]
        if keyword_slots:
            return function(*bound, **{**kwargs, **{key: tensors[index] for key, index in keyword_slots}})
        return function(*bound, **kwargs)

    return call


def _nested(values: list[Any], *, top: bool) -> bool:
    """A TensorArg below the top level, or a device anywhere: needs ``bind_call``."""
    for value in values:
        if isinstance(value, torch.device) or (isinstance(value, TensorArg) and not top):
            return True
        if isinstance(value, list | tuple) and _nested(list(value), top=False):
            return True
        if isinstance(value, slice) and _nested([value.start, value.stop, value.step], top=False):
            return True
    return False


def attribute_name(name: str) -> str:
    """A parameter's fully qualified name as one module attribute (no dots)."""
    return name.replace(".", "__")


class GraphModule(nn.Module):
    """``forward(*segment.inputs) -> tuple(segment.outputs)``, by interpreting the graph's nodes."""

    def __init__(
        self,
        graph: OpGraph,
        segment: Segment,
        *,
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        call_node: NodeCaller | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.segment = segment
        self._nodes = tuple(graph.node(name) for name in segment.nodes)
        if call_node is None:
            callers = {node.name: compile_node(node, device=device) for node in self._nodes}
            call_node = lambda node, tensors: callers[node.name](tensors)  # noqa: E731
        self._call_node = call_node
        self.graph_params = nn.ParameterDict({attribute_name(n): _as_parameter(params[n]) for n in segment.params})
        self._buffers_by_name = {name: buffers[name] for name in segment.buffers}

    def named_graph_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(fully qualified name in the model, parameter)`` for every parameter this segment uses."""
        return [(name, self.graph_params[attribute_name(name)]) for name in self.segment.params]

    def forward(self, *values: Any) -> tuple[Any, ...]:
        assert len(values) == len(self.segment.inputs), "a segment takes one argument per input value"
        env: dict[str, Any] = dict(zip(self.segment.inputs, values, strict=True))
        env.update(self._buffers_by_name)
        env.update(self.named_graph_parameters())
        for node in self._nodes:
            env[node.name] = self._call_node(node, [env[name] for name in node.inputs])
        return tuple(env[name] for name in self.segment.outputs)


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)


def model_tensors(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """Parameters and buffers by the names the graph uses (``named_parameters`` names)."""
    return dict(model.named_parameters()), dict(model.named_buffers())


def check_same_nodes(reference: OpGraph, other: OpGraph, *, what: str) -> None:
    """Two captures of one model (at different batch sizes) must have the same nodes in the same order."""
    from planner.errors import AutoplanError

    names = [(n.name, n.target) for n in reference.nodes]
    others = [(n.name, n.target) for n in other.nodes]
    if names != others:
        first = (
            next((a, b) for a, b in zip(names, others, strict=False) if a != b) if len(names) == len(others) else None
        )
        raise AutoplanError(
            f"the model captured at {what} has different nodes from the planned capture "
            f"({len(others)} vs {len(names)} nodes{f', first difference {first}' if first else ''}); "
            "plan with --microbatches 1 or make the model's graph independent of the batch size"
        )


def flat_outputs(values: Sequence[Any]) -> Any:
    """A model's output as its loss function sees it: the value itself when there is one."""
    return values[0] if len(values) == 1 else tuple(values)
