"""Builds an :class:`~planner.ir.graph.OpGraph` node by node for :mod:`planner.ir.capture` (both tracers):
each operator's outputs, FLOPs and bytes from a run on meta tensors, once per distinct signature."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec

from planner.errors import AutoplanError, warn
from planner.ir.custom_flops import custom_flops, is_custom
from planner.ir.graph import (
    GraphConstant,
    GraphValue,
    NodeKind,
    OpGraph,
    OpNode,
    OutputTree,
    TensorArg,
    TensorMeta,
    ValueKind,
    op_base_name,
)
from planner.ir.node_call import MetaResult, tensor_meta, trace_on_meta
from planner.ir.op_kinds import classify


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


class GraphBuilder:
    """Collects values and nodes; costs each distinct operator signature once."""

    def __init__(self) -> None:
        self.values: dict[str, GraphValue] = {}
        self.metas: dict[str, TensorMeta] = {}
        self.nodes: list[OpNode] = []
        self.outputs: list[str] = []
        self.output_tree: OutputTree | None = None
        self.constants: list[GraphConstant] = []
        self.multi_outputs: dict[str, tuple[TensorMeta, ...]] = {}
        self._meta_cache: dict[str, MetaResult | None] = {}
        self.unknown_custom: set[str] = set()

    def add_value(self, *, name: str, kind: ValueKind, meta: TensorMeta) -> None:
        self.values[name] = GraphValue(name=name, kind=kind, meta=meta)
        self.metas[name] = meta

    def add_constant(self, *, name: str, tensor: torch.Tensor) -> None:
        """A lifted constant: a buffer of the graph whose values the graph keeps."""
        meta = tensor_meta(tensor)
        self.add_value(name=name, kind=ValueKind.BUFFER, meta=meta)
        self.constants.append(GraphConstant(name=name, meta=meta, values=tuple(tensor.detach().flatten().tolist())))

    def set_outputs(self, leaves: list[tuple[str | None, Any]], spec: TreeSpec) -> None:
        """The graph's outputs: ``leaves`` are the output's leaves in order, each ``(value name, None)`` for a
        tensor of the graph or ``(None, constant)``; ``spec`` is the output's structure over them."""
        self.outputs.extend(name for name, _ in leaves if name is not None)
        self.output_tree = OutputTree(
            spec=spec, leaves=tuple(name for name, _ in leaves), constants=tuple(value for _, value in leaves)
        )

    def add_node(
        self,
        *,
        name: str,
        target: str,
        args: tuple[Any, ...],
        kwargs: tuple[tuple[str, Any], ...],
        inputs: tuple[str, ...],
        module_path: str,
        known_outputs: tuple[TensorMeta, ...] | None = None,
    ) -> None:
        input_metas = tuple(self.metas[value] for value in inputs)
        if op_base_name(target) == "getitem" and inputs and inputs[0] in self.multi_outputs:
            input_metas = (self.multi_outputs[inputs[0]][args[1]],)
            result: MetaResult | None = MetaResult(outputs=input_metas, flops_fwd=0, flops_bwd=0)
        else:
            frozen = tuple(self.values[v].kind == ValueKind.BUFFER if v in self.values else False for v in inputs)
            result = self._trace(target, args, kwargs, input_metas, frozen)
        if result is None and known_outputs is None:
            raise AutoplanError(f"cannot run operator {target} (node {name}) on meta tensors to get its shapes")
        outputs = result.outputs if result is not None else known_outputs
        assert outputs is not None
        if len(outputs) > 1:
            self.multi_outputs[name] = outputs
        kind = classify(op_base_name(target), input_metas, outputs)
        params = tuple(
            dict.fromkeys(v for v in inputs if self.values.get(v, None) and self.values[v].kind == ValueKind.PARAM)
        )
        moved = 0 if kind == NodeKind.VIEW else sum(m.nbytes for m in (*input_metas, *outputs))
        flops_fwd, flops_bwd = (result.flops_fwd, result.flops_bwd) if result else (0, 0)
        if flops_fwd == 0 and is_custom(target):
            known = custom_flops(target, input_metas, outputs)
            if known is not None:
                flops_fwd, flops_bwd = known, 2 * known
            elif target not in self.unknown_custom:
                self.unknown_custom.add(target)
                warn(f"no FLOP count for custom operator {target} (node {name}): its time is its bytes moved alone")
        node = OpNode(
            name=name,
            target=target,
            kind=kind,
            inputs=inputs,
            input_metas=input_metas,
            outputs=outputs,
            params=params,
            args=args,
            kwargs=kwargs,
            flops_fwd=flops_fwd,
            flops_bwd=flops_bwd,
            bytes_moved=moved,
            module_path=module_path,
        )
        self.nodes.append(node)
        self.metas[name] = outputs[0]

    def _trace(
        self, target: str, args: Any, kwargs: Any, input_metas: tuple[TensorMeta, ...], frozen: tuple[bool, ...]
    ) -> MetaResult | None:
        key = f"{target}|{input_metas}|{frozen}|{args!r}|{kwargs!r}"
        if key not in self._meta_cache:
            try:
                self._meta_cache[key] = trace_on_meta(target, args, kwargs, input_metas, frozen=frozen)
            except Exception as error:
                warn(f"could not run {target} on meta tensors ({first_line(error)})")
                self._meta_cache[key] = None
        return self._meta_cache[key]

    def finish(self) -> OpGraph:
        by_kind = {kind: [v for v in self.values.values() if v.kind == kind] for kind in ValueKind}
        return OpGraph(
            nodes=tuple(self.nodes),
            inputs=tuple(by_kind[ValueKind.INPUT]),
            params=tuple(by_kind[ValueKind.PARAM]),
            buffers=tuple(by_kind[ValueKind.BUFFER]),
            outputs=tuple(self.outputs),
            constants=tuple(self.constants),
            output_tree=self.output_tree,
        )


def freeze_args(
    args: Any, kwargs: dict[str, Any], lookup: Callable[[fx.Node], Any]
) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...], tuple[str, ...]]:
    """Replace tensor-valued fx nodes by TensorArg, other nodes by their constant value."""
    inputs: list[str] = []

    def freeze(value: Any) -> Any:
        if isinstance(value, fx.Node):
            resolved = lookup(value)
            if isinstance(resolved, str):
                inputs.append(resolved)
                return TensorArg(len(inputs) - 1)
            return resolved
        if isinstance(value, list | tuple):
            return tuple(freeze(item) for item in value)
        if isinstance(value, dict):
            return tuple((key, freeze(item)) for key, item in value.items())
        if isinstance(value, slice):
            return slice(freeze(value.start), freeze(value.stop), freeze(value.step))
        return value

    frozen_args = tuple(freeze(arg) for arg in args)
    frozen_kwargs = tuple((key, freeze(value)) for key, value in kwargs.items())
    return frozen_args, frozen_kwargs, tuple(inputs)
