"""Run part of a captured :class:`~planner.ir.graph.OpGraph` as an ``nn.Module``.

The plan names graph nodes, so executors run the graph the plan was made for, not the user's
``forward``: :class:`GraphModule` interprets a :class:`Segment` — some nodes of the graph, the
values it reads from outside (graph inputs, or values computed by another stage) and the values it
hands on — calling each node's operator again with :func:`planner.ir.node_call.resolve_target` and
:func:`planner.ir.node_call.bind_call`. Parameters and buffers are taken by name from the real model,
so a segment's gradients are the model's gradients by name.

The runners hand the loss the model's output as ``forward`` returns it (a tensor, a tuple, a dict, a
``ModelOutput``): :func:`model_output` rebuilds it from the values of :func:`output_names`.

A ``call_node`` hook lets tensor parallelism run each node on DTensors
(:mod:`executors.parallel.tensor_parallel`); the default runs it on plain tensors.

Recomputation: each run of ``checkpointed`` nodes (a plan stage's ``Stage.recomputed_runs``, consecutive
in the segment) runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): forward keeps only the
values entering the run, and backward runs the run's nodes again before their own backward. Parameters
and buffers are read again when the run is recomputed, not kept (so FSDP may free a parameter it
gathered between forward and backward); random operators draw the same numbers again (checkpoint
restores the RNG state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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
        checkpointed: Sequence[Sequence[str]] = (),
    ) -> None:
        super().__init__()
        self.segment = segment
        self._nodes = tuple(graph.node(name) for name in segment.nodes)
        self._program = _program(graph, self._nodes, checkpointed, needed=segment.outputs)
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
        for step in self._program:
            if isinstance(step, Run):
                outputs = checkpoint(self._run, step, *(env[name] for name in step.inputs), use_reentrant=False)
                env.update(zip(step.outputs, outputs, strict=True))
            else:
                env[step.name] = self._call_node(step, [env[name] for name in step.inputs])
        return tuple(env[name] for name in self.segment.outputs)

    def _run(self, run: Run, *values: Any) -> tuple[Any, ...]:
        """One checkpointed run: its nodes on the values entering it, parameters and buffers read now."""
        env: dict[str, Any] = dict(self._buffers_by_name)
        env.update(self.named_graph_parameters())
        env.update(zip(run.inputs, values, strict=True))
        for node in run.nodes:
            env[node.name] = self._call_node(node, [env[name] for name in node.inputs])
        return tuple(env[name] for name in run.outputs)


@dataclass(frozen=True, kw_only=True)
class Run:
    """Consecutive nodes run under one activation checkpoint: the values entering it (no parameter or buffer)
    and those it hands on (read after it, or the segment's outputs)."""

    nodes: tuple[OpNode, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def _program(
    graph: OpGraph, nodes: tuple[OpNode, ...], checkpointed: Sequence[Sequence[str]], *, needed: Sequence[str]
) -> tuple[OpNode | Run, ...]:
    """The segment's nodes in order, each checkpointed run as one :class:`Run`."""
    position = {node.name: index for index, node in enumerate(nodes)}
    starts: dict[int, tuple[str, ...]] = {}
    for run in checkpointed:
        if run:
            assert all(name in position for name in run), "a checkpointed run lies in the segment"
            starts[position[run[0]]] = tuple(run)
    held = {param.name for param in graph.params} | {buffer.name for buffer in graph.buffers}
    program: list[OpNode | Run] = []
    index = 0
    while index < len(nodes):
        if index not in starts:
            program.append(nodes[index])
            index += 1
            continue
        members = nodes[index : index + len(starts[index])]
        assert tuple(node.name for node in members) == starts[index], "a checkpointed run is consecutive"
        made = {node.name for node in members}
        inputs = dict.fromkeys(
            value for node in members for value in node.inputs if value not in made and value not in held
        )
        later = {value for node in nodes[index + len(members) :] for value in node.inputs} | set(needed)
        outputs = tuple(node.name for node in members if node.name in later)
        program.append(Run(nodes=tuple(members), inputs=tuple(inputs), outputs=outputs))
        index += len(members)
    return tuple(program)


class LayeredGraphModule(nn.Module):
    """A :class:`GraphModule` cut into one child per group of consecutive nodes (the layers FSDP shards by:
    :func:`executors.parallel.data_parallel.fsdp_groups`): each child holds the parameters only its group reads, the
    root those several groups read (tied embeddings). ``forward`` is the segment's, run child by child."""

    def __init__(
        self,
        graph: OpGraph,
        segment: Segment,
        *,
        groups: Sequence[Sequence[str]],
        params: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        device: str = "cpu",
        checkpointed: Sequence[Sequence[str]] = (),
    ) -> None:
        super().__init__()
        self.segment = segment
        readers: dict[str, set[int]] = {}
        for index, group in enumerate(groups):
            for name in group:
                for value in graph.node(name).inputs:
                    readers.setdefault(value, set()).add(index)
        shared = [name for name in segment.params if len(readers.get(name, ())) > 1]
        self.shared_params = nn.ParameterDict({attribute_name(n): _as_parameter(params[n]) for n in shared})
        parts = []
        for index, group in enumerate(groups):
            later = {value for other in groups[index + 1 :] for name in other for value in graph.node(name).inputs}
            made = set(group)
            part = make_segment(graph, group, needed_after=[v for v in (*later, *segment.outputs) if v in made])
            part = replace(
                part,
                inputs=part.inputs + tuple(n for n in part.params if n in shared),
                params=tuple(n for n in part.params if n not in shared),
            )
            runs = [run for run in checkpointed if run and run[0] in made]
            parts.append(GraphModule(graph, part, params=params, buffers=buffers, device=device, checkpointed=runs))
        self.parts = nn.ModuleList(parts)
        self._buffers_by_name = {name: buffers[name] for name in segment.buffers}
        self._shared = tuple(shared)

    def named_graph_parameters(self) -> list[tuple[str, nn.Parameter]]:
        found = dict(pair for part in self.parts for pair in part.named_graph_parameters())
        found.update((name, self.shared_params[attribute_name(name)]) for name in self._shared)
        return [(name, found[name]) for name in self.segment.params]

    def forward(self, *values: Any) -> tuple[Any, ...]:
        env: dict[str, Any] = dict(zip(self.segment.inputs, values, strict=True))
        env.update((name, self.shared_params[attribute_name(name)]) for name in self._shared)
        for part in self.parts:
            outputs = part(*(env[name] for name in part.segment.inputs))
            env.update(zip(part.segment.outputs, outputs, strict=True))
        return tuple(env[name] for name in self.segment.outputs)


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)


def model_tensors(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """Parameters and buffers by the names the graph uses (``named_parameters`` names)."""
    return dict(model.named_parameters()), dict(model.named_buffers())


def check_same_nodes(reference: OpGraph, other: OpGraph, *, what: str) -> None:
    """Two captures of one model (at different batch sizes) must have the same nodes in the same order (the planner
    refuses a plan where they differ: planner.inter.runnable_rows)."""
    from planner.errors import AutoplanError
    from planner.ir.graph import node_difference

    difference = node_difference(reference, other)
    if difference is not None:
        raise AutoplanError(
            f"the model captured at {what} has different nodes from the planned capture ({difference}); "
            "plan with --microbatches 1 or make the model's graph independent of the batch size"
        )


def output_names(graph: OpGraph) -> tuple[str, ...]:
    """The values a runner hands the loss, in order: the graph's outputs, each once (no parameter)."""
    params = set(graph.param_names)
    return tuple(name for name in dict.fromkeys(graph.outputs) if name not in params)


def model_output(graph: OpGraph, values: Sequence[Any]) -> Any:
    """The model's output as its loss function sees it, from the values of :func:`output_names` in order: the
    structure the model returns (a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``:
    :meth:`planner.ir.graph.OutputTree.rebuild`); for a graph that crossed processes (it keeps no structure),
    the value itself when there is one, else their tuple."""
    tree = graph.output_tree
    if tree is None:
        return values[0] if len(values) == 1 else tuple(values)
    return tree.rebuild(dict(zip(output_names(graph), values, strict=True)))
