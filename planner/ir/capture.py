"""nn.Module + example inputs -> :class:`~planner.ir.graph.OpGraph`.

Two tracers produce the same IR:

* ``export`` (default): ``torch.export.export(model, inputs, strict=False)``, the training
  IR — ATen operators such as ``aten.linear.default`` and
  ``aten.scaled_dot_product_attention.default``. Works on HF transformers models.
* ``fx``: ``torch.fx`` symbolic tracing with every module traced through, so ``nn.Linear``
  becomes ``torch._C._nn.linear`` on its ``get_attr`` weight; then an interpretation on meta
  tensors gives shapes and folds shape arithmetic into constants.

Models built under ``with torch.device("meta"):`` are captured without allocating weights:
every operator is re-run on meta tensors by :func:`planner.ir.node_call.trace_on_meta` (once per
distinct signature — identical layers cost one call) for output shapes and FLOPs.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import unittest.mock
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from planner.errors import AutoplanError
from planner.ir.graph import OpGraph, TensorMeta, ValueKind
from planner.ir.graph_builder import GraphBuilder, first_line, freeze_args
from planner.ir.node_call import (
    bind_call,
    resolve_target,
    target_name,
    tensor_meta,
    torch_dtype,
)
from planner.ir.repeated_layers import capture_repeated

TRACERS = ("export", "fx")


def capture(
    model: torch.nn.Module, example_inputs: Sequence[Any], *, tracer: str = "export", reuse_layers: bool = False
) -> OpGraph:
    """Trace ``model`` on ``example_inputs`` into an :class:`OpGraph`.

    ``reuse_layers`` (the planner's captures; the ranks export whole and check the fingerprint): a stack of
    identical layers is exported at a few layers and written out at its length
    (:func:`planner.ir.repeated_layers.capture_repeated`), the same graph as the whole export.
    Raises :class:`AutoplanError` naming the tracer and the first line of its complaint when
    the model cannot be captured.
    """
    if tracer not in TRACERS:
        raise AutoplanError(f"unknown tracer {tracer!r}: choose one of {', '.join(TRACERS)}")
    inputs = tuple(example_inputs)
    check_arity(model, inputs)
    if tracer == "export":

        def export() -> OpGraph:
            builder = GraphBuilder()
            with _as_fake_cpu(model, inputs) if _on_meta(model) else contextlib.nullcontext(inputs) as traced:
                _capture_export(model, traced, builder)
            return builder.finish()

        written = capture_repeated(model, export) if reuse_layers else None
        return written if written is not None else export()
    builder = GraphBuilder()
    if _on_meta(model):
        inputs = tuple(tree_map(_to_meta, list(inputs)))
    _capture_fx(model, inputs, builder)
    return builder.finish()


@contextlib.contextmanager
def _as_fake_cpu(model: torch.nn.Module, inputs: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """While exporting, the meta model's parameters, buffers and inputs are fake CPU tensors: no memory,
    and code that branches on ``device.type`` (HF's MoE routing) takes the path it takes on a CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:  # a tied tensor stays one tensor
            with mode:
                made = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            if isinstance(tensor, torch.nn.Parameter):
                made = torch.nn.Parameter(made, requires_grad=tensor.requires_grad)
            fakes[id(tensor)] = made
        return fakes[id(tensor)]

    saved = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    saved.append((table, name, tensor))
                    table[name] = fake(tensor)
    try:
        yield tuple(fake(x) if isinstance(x, torch.Tensor) and x.is_meta else x for x in inputs)
    finally:
        for table, name, tensor in saved:
            table[name] = tensor


def check_arity(model: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
    """``forward`` must accept the example inputs as positional arguments; else say how many it takes."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return  # a forward without a signature (a builtin): let the tracer judge
    try:
        signature.bind(*inputs)
    except TypeError:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = [p for p in signature.parameters.values() if p.kind in kinds]
        required = [p.name for p in params if p.default is inspect.Parameter.empty]
        takes = f"{len(required)}" if len(required) == len(params) else f"{len(required)} to {len(params)}"
        raise AutoplanError(
            f"{type(model).__name__}.forward takes {takes} input(s) ({', '.join(p.name for p in params) or 'none'}) "
            f"but example_inputs gives {len(inputs)}: return only forward's inputs from example_inputs "
            "(targets such as labels go in example_targets)"
        ) from None


def _on_meta(model: torch.nn.Module) -> bool:
    return any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers()))


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else str(path)


def _val_metas(value: Any) -> tuple[TensorMeta, ...]:
    flat, _ = tree_flatten(value)
    return tuple(tensor_meta(item) for item in flat if isinstance(item, torch.Tensor))


# what torch.export (a guard on an unbacked symbol) and torch.fx (a Proxy in an `if`) say of a branch on data
_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "data-dependent expression", "used as inputs to control flow")


def _tracer_error(what: str, error: Exception, *, other: str) -> str:
    """The one line for a capture that failed: a branch on a tensor's value is named with what to change (no
    tracer captures it, so the other tracer is no advice); any other failure suggests the other tracer."""
    text = f"{what} the model ({first_line(error)})"
    if any(marker in str(error) or marker in type(error).__name__ for marker in _DATA_DEPENDENT):
        return (
            f"{text}: the forward branches on a tensor's value, which no tracer can capture; branch on a Python "
            "flag or on the input's shape instead, or write the branch with torch.cond"
        )
    return f"{text}; try --tracer {other}"


def _capture_export(model: torch.nn.Module, inputs: tuple[Any, ...], builder: GraphBuilder) -> None:
    from torch.export import export
    from torch.export.graph_signature import InputKind

    try:  # export prints the failing graph on errors; per-node stack traces cost ~20% of its time, unread here
        with contextlib.redirect_stderr(io.StringIO()), _without_stack_traces():
            program = export(model, inputs, strict=False)
    except Exception as error:
        raise AutoplanError(_tracer_error("torch.export could not capture", error, other="fx")) from None
    if _has_opaque_calls(program.graph):
        try:  # lowers predispatch vmap (HF transformers 4.5x masks) and higher-order ops to plain ATen
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's own LeafSpec deprecation
                program = program.run_decompositions({})
        except Exception as error:
            raise AutoplanError(f"torch.export could not lower the model to ATen ({first_line(error)})") from None
    kinds = {InputKind.PARAMETER: ValueKind.PARAM, InputKind.USER_INPUT: ValueKind.INPUT}
    canonical = _canonical_names(model)
    names: dict[str, str] = {}
    for spec in program.graph_signature.input_specs:
        placeholder = spec.arg.name
        names[placeholder] = canonical(spec.target) if spec.target is not None else placeholder
    constants: dict[str, Any] = {}
    spec_of = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = spec_of[node.name]
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                constants[node.name] = value
                continue
            if spec.kind == InputKind.CONSTANT_TENSOR and _has_data(program.constants.get(spec.target)):
                builder.add_constant(name=names[node.name], tensor=program.constants[spec.target])
                continue
            builder.add_value(
                name=names[node.name], kind=kinds.get(spec.kind, ValueKind.BUFFER), meta=tensor_meta(value)
            )
        elif node.op == "call_function":
            value = node.meta.get("val")
            metas = _val_metas(value)
            if not metas:
                constants[node.name] = value
                continue

            def lookup(arg: fx.Node) -> Any:
                return constants[arg.name] if arg.name in constants else names.get(arg.name, arg.name)

            args, kwargs, node_inputs = freeze_args(node.args, dict(node.kwargs), lookup)
            builder.add_node(
                name=node.name,
                target=target_name(node.target),
                args=args,
                kwargs=kwargs,
                inputs=node_inputs,
                module_path=_module_path(node),
                known_outputs=metas,
            )
        elif node.op == "output":
            flat, _ = tree_flatten(node.args)
            builder.set_outputs([_export_leaf(item, names, constants) for item in flat], program.call_spec.out_spec)


def _export_leaf(item: Any, names: dict[str, str], constants: dict[str, Any]) -> tuple[str | None, Any]:
    """One leaf of the exported output: ``(value name, None)`` for a tensor of the graph, else ``(None, value)``
    (a ``None``, a number, or a non-tensor value computed in the forward)."""
    if not isinstance(item, fx.Node):
        return None, item
    if item.name in constants:
        return None, constants[item.name]
    return names.get(item.name, item.name), None


def _has_data(tensor: Any) -> bool:
    """A real tensor (a lifted constant made in the forward), not a fake one standing for a meta buffer."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, FakeTensor) and not tensor.is_meta


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """torch.fx records a Python stack trace per traced node (``fx.config.do_not_emit_stack_traces``);
    capture reads none, so it is switched off for the export and restored after (where this torch has the switch:
    torch 2.11 has none). The shape solver's warnings
    (its own log handler, which ``redirect_stderr`` does not reach) are held back too: a failed export is
    reported in one line."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        with contextlib.ExitStack() as stack:
            if hasattr(torch.fx.config, "do_not_emit_stack_traces"):
                stack.enter_context(unittest.mock.patch.object(torch.fx.config, "do_not_emit_stack_traces", True))
            yield
    finally:
        shapes_log.setLevel(level)


def _has_opaque_calls(graph: fx.Graph) -> bool:
    """True when the graph holds calls that are not ATen operators: vmap levels, higher-order ops."""
    for node in graph.nodes:
        if node.op == "get_attr":
            return True
        if node.op == "call_function" and (
            isinstance(node.target, torch._ops.HigherOrderOperator)
            or str(getattr(node.target, "__module__", "")).startswith("torch._functorch")
        ):
            return True
    return False


def _canonical_names(model: torch.nn.Module) -> Callable[[str], str]:
    """Export names a tied parameter by any of its paths; map each to ``named_parameters()``'s name."""
    first = {id(tensor): name for name, tensor in (*model.named_parameters(), *model.named_buffers())}

    def canonical(target: str) -> str:
        try:
            tensor = _attr(model, target)
        except AttributeError:
            return target  # a lifted constant: no attribute of the model
        return first.get(id(tensor), target)

    return canonical


class _ThroughTracer(fx.Tracer):
    """Traces into every module, so standard layers become functional calls on weights."""

    def is_leaf_module(self, module: torch.nn.Module, module_qualified_name: str) -> bool:
        return False


def _capture_fx(model: torch.nn.Module, inputs: tuple[Any, ...], builder: GraphBuilder) -> None:
    try:
        graph = _ThroughTracer().trace(model)
    except Exception as error:
        raise AutoplanError(_tracer_error("torch.fx could not trace", error, other="export")) from None
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    env: dict[str, Any] = {}
    remaining = list(inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            value = remaining.pop(0) if remaining else node.args[0] if node.args else None
            env[node.name] = value
            if isinstance(value, torch.Tensor):
                builder.add_value(name=node.name, kind=ValueKind.INPUT, meta=tensor_meta(value))
                env[node.name] = (node.name, value)
        elif node.op == "get_attr":
            _fx_get_attr(node, model, params, buffers, env, builder)
        elif node.op in ("call_function", "call_method"):
            _fx_call(node, env, builder)
        elif node.op == "output":
            flat, spec = tree_flatten(node.args[0])
            builder.set_outputs([_fx_leaf(item, env, builder) for item in flat], spec)
        elif node.op == "call_module":
            raise AutoplanError(f"torch.fx kept module {node.target} opaque; try --tracer export")


def _fx_leaf(item: Any, env: dict, builder: GraphBuilder) -> tuple[str | None, Any]:
    """One leaf of the traced output: ``(value name, None)`` for a tensor of the graph, else ``(None, value)``."""
    if not isinstance(item, fx.Node):
        return None, item
    value = env[item.name]
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and value[0] in builder.metas:
        return value[0], None
    return None, value


def _fx_get_attr(
    node: fx.Node, model: torch.nn.Module, params: dict, buffers: dict, env: dict, builder: GraphBuilder
) -> None:
    target = str(node.target)
    value = params.get(target)
    kind = ValueKind.PARAM
    if value is None:
        value = buffers.get(target)
        kind = ValueKind.BUFFER
    if value is None:
        value = _attr(model, target)
    if not isinstance(value, torch.Tensor):
        env[node.name] = value
        return
    if target not in builder.values:
        builder.add_value(name=target, kind=kind, meta=tensor_meta(value))
    env[node.name] = (target, value)


def _attr(model: torch.nn.Module, target: str) -> Any:
    found: Any = model
    for part in target.split("."):
        found = getattr(found, part)
    return found


def _fx_call(node: fx.Node, env: dict, builder: GraphBuilder) -> None:
    is_method = node.op == "call_method"
    target = target_name(node.target, is_method=is_method)

    def lookup(arg: fx.Node) -> Any:
        value = env[arg.name]
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            return value[0]  # a tensor value: its graph name
        return value

    args, kwargs, node_inputs = freeze_args(node.args, dict(node.kwargs), lookup)
    function = resolve_target(target)
    tensors = [
        torch.empty(builder.metas[n].shape, dtype=torch_dtype(builder.metas[n].dtype), device="meta")
        for n in node_inputs
    ]
    call_args, call_kwargs = bind_call(args, kwargs, tensors, device="meta")
    try:
        result = function(*call_args, **call_kwargs)
    except Exception as error:
        raise AutoplanError(f"could not run {target} (node {node.name}) on meta tensors: {first_line(error)}") from None
    if isinstance(result, torch.Tensor) or _val_metas(result):
        builder.add_node(
            name=node.name, target=target, args=args, kwargs=kwargs, inputs=node_inputs, module_path=_module_path(node)
        )
        env[node.name] = (node.name, result)
    else:
        env[node.name] = result
