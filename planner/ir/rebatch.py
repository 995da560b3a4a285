"""The model's graph at every microbatch size, from at most two captures.

Exporting a large model takes seconds, so :class:`MicrobatchGraphs` captures it at the global
batch ``B`` and at the smallest microbatch size ``b₀`` only. Every quantity that depends on the
batch — each tensor dim, each integer in an operator's arguments (a ``view``'s shape), FLOPs and
bytes moved — is an affine function of the batch size ``b`` for ordinary models (constant, or
``b`` times a constant, or a sum of both), so two points fix it::

    q(b) = q(b₀) + (q(B) − q(b₀))·(b − b₀)/(B − b₀)                          (_interpolate)

An interpolated graph is used only when both captures have the same nodes, targets and wiring
and every interpolated dim and argument is a whole number (:func:`_between`); otherwise that
size is captured directly. ``capture_at(b)`` must return the graph of the same model at batch
``b`` (:func:`planner.api.plan` slices the example inputs along dim 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import Any

import torch

from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.graph import GraphValue, OpGraph, OpNode, TensorMeta
from planner.ir.parallel_capture import start_capture


class _NotAffine(Exception):
    """Two captures that no affine rule joins at this size."""


class MicrobatchGraphs:
    """``at(b)``: the graph at microbatch size ``b`` (``b`` divides the batch), cached per size."""

    def __init__(
        self,
        *,
        full: OpGraph,
        batch_size: int,
        capture_at: Callable[[int], OpGraph],
        smallest: int | None = None,
        smallest_graph: OpGraph | None = None,
    ) -> None:
        """``smallest_graph``: the graph at ``smallest`` when it was captured already (in a child process,
        :mod:`planner.ir.parallel_capture`); else it is captured here."""
        self.batch_size = batch_size
        self.full = full
        self._capture_at = capture_at
        self._graphs: dict[int, OpGraph] = {batch_size: full}
        self._low: int | None = None
        self.num_captures = 1
        self.capture_s = 0.0  # seconds in captures after the first
        if smallest is not None and smallest != batch_size:
            if smallest_graph is None:
                smallest_graph = self._capture(smallest)
            else:
                self.num_captures += 1
            self._graphs[smallest] = smallest_graph
            self._low = smallest

    def _capture(self, size: int) -> OpGraph:
        started = time.perf_counter()
        self.num_captures += 1
        graph = self._capture_at(size)
        self.capture_s += time.perf_counter() - started
        return graph

    def outputs_batch_major(self) -> bool:
        """Whether each of the model's outputs has the batch in its dim 0 (``k`` entries per batch row, ``k`` the
        same at every batch: :func:`outputs_scale_with_batch`), as two captures prove; False with one capture
        (nothing to compare). :func:`planner.plan.stage.loss_row_axes` splits the outputs by rows when it holds."""
        if self._low is None:
            return False
        return outputs_scale_with_batch(self._graphs[self._low], self.full, sizes=(self._low, self.batch_size))

    def at(self, size: int) -> OpGraph:
        if size not in self._graphs:
            graph = None
            if self._low is not None and self._low < size < self.batch_size:
                try:
                    low, high = self._graphs[self._low], self._graphs[self.batch_size]
                    graph = _between(low, high, sizes=(self._low, self.batch_size, size))
                except _NotAffine:
                    graph = None
            self._graphs[size] = graph if graph is not None else self._capture(size)
        return self._graphs[size]


def _between(low: OpGraph, high: OpGraph, *, sizes: tuple[int, int, int]) -> OpGraph:
    """The graph at ``size`` from ``low`` (at ``low_size``) and ``high`` (at ``high_size``)."""
    low_size, high_size, size = sizes
    if len(low.nodes) != len(high.nodes):
        raise _NotAffine
    t = Fraction(size - low_size, high_size - low_size)
    metas: dict[tuple[TensorMeta, TensorMeta], TensorMeta] = {}  # identical layers repeat the same pairs
    nodes = tuple(_node(a, b, t, metas) for a, b in zip(low.nodes, high.nodes, strict=True))
    return OpGraph(
        nodes=nodes,
        inputs=tuple(_value(a, b, t) for a, b in _pairs(low.inputs, high.inputs)),
        params=high.params,
        buffers=tuple(_value(a, b, t) for a, b in _pairs(low.buffers, high.buffers)),
        outputs=high.outputs,
        constants=high.constants,
        output_tree=high.output_tree,
    )


def outputs_scale_with_batch(low: OpGraph, high: OpGraph, *, sizes: tuple[int, int]) -> bool:
    """Every output's dim 0 is ``k`` times the batch in both graphs (``low`` at ``sizes[0]`` rows, ``high`` at
    ``sizes[1]``), with the same whole ``k``."""
    low_size, high_size = sizes
    if low_size == high_size or len(low.outputs) != len(high.outputs) or not high.outputs:
        return False
    for a, b in zip(low.outputs, high.outputs, strict=True):
        low_shape, high_shape = _output_meta(low, a).shape, _output_meta(high, b).shape
        if not low_shape or not high_shape or high_shape[0] % high_size:
            return False
        if low_shape[0] * high_size != high_shape[0] * low_size:
            return False
    return True


def _output_meta(graph: OpGraph, name: str) -> TensorMeta:
    return graph.node(name).output if graph.has_node(name) else graph.value(name).meta


def _pairs(low: tuple[GraphValue, ...], high: tuple[GraphValue, ...]) -> list[tuple[GraphValue, GraphValue]]:
    if [v.name for v in low] != [v.name for v in high]:
        raise _NotAffine
    return list(zip(low, high, strict=True))


def _interpolate(a: int, b: int, t: Fraction) -> int:
    if a == b:
        return a
    step, rest = divmod((b - a) * t.numerator, t.denominator)  # integers: Fraction arithmetic is slow
    if rest or a + step < 0:
        raise _NotAffine
    return a + step


def _meta(a: TensorMeta, b: TensorMeta, t: Fraction) -> TensorMeta:
    if a.dtype != b.dtype or len(a.shape) != len(b.shape):
        raise _NotAffine
    return TensorMeta(shape=tuple(_interpolate(x, y, t) for x, y in zip(a.shape, b.shape, strict=True)), dtype=b.dtype)


def _value(a: GraphValue, b: GraphValue, t: Fraction) -> GraphValue:
    return replace(b, meta=_meta(a.meta, b.meta, t))


def _arg(a: Any, b: Any, t: Fraction) -> Any:
    if isinstance(b, bool) or not isinstance(b, int | tuple):
        if a != b and not (isinstance(a, float) and isinstance(b, float)):
            raise _NotAffine
        return b
    if isinstance(b, int):
        if not isinstance(a, int):
            raise _NotAffine
        return _interpolate(a, b, t)
    if not isinstance(a, tuple) or len(a) != len(b):
        raise _NotAffine
    return tuple(_arg(x, y, t) for x, y in zip(a, b, strict=True))


def _node(a: OpNode, b: OpNode, t: Fraction, metas: dict[tuple[TensorMeta, TensorMeta], TensorMeta]) -> OpNode:
    if (a.name, a.target, a.inputs, len(a.outputs)) != (b.name, b.target, b.inputs, len(b.outputs)):
        raise _NotAffine

    def meta(x: TensorMeta, y: TensorMeta) -> TensorMeta:
        if (x, y) not in metas:
            metas[x, y] = _meta(x, y, t)
        return metas[x, y]

    return replace(
        b,
        input_metas=tuple(meta(x, y) for x, y in zip(a.input_metas, b.input_metas, strict=True)),
        outputs=tuple(meta(x, y) for x, y in zip(a.outputs, b.outputs, strict=True)),
        args=_arg(a.args, b.args, t),
        kwargs=tuple((key, _arg(x, y, t)) for (key, x), (_, y) in zip(a.kwargs, b.kwargs, strict=True)),
        flops_fwd=_round_between(a.flops_fwd, b.flops_fwd, t),
        flops_bwd=_round_between(a.flops_bwd, b.flops_bwd, t),
        bytes_moved=_round_between(a.bytes_moved, b.bytes_moved, t),
    )


def _round_between(a: int, b: int, t: Fraction) -> int:
    """``round(a + (b − a)·t)`` (half to even, as ``round`` of a Fraction) without Fraction arithmetic."""
    return a if a == b else round(a + Fraction((b - a) * t.numerator, t.denominator))


def capture_graphs(
    model: torch.nn.Module, example_inputs: Sequence[Any], *, batch_size: int, smallest: int, tracer: str, jobs: int
) -> MicrobatchGraphs:
    """The graph at the batch and at the smallest microbatch; with ``jobs > 1`` the second export runs in a
    forked child at the same time as the first (:mod:`planner.ir.parallel_capture`)."""

    def capture_at(size: int) -> OpGraph:
        return capture(model, slice_batch(example_inputs, batch_size, size), tracer=tracer, reuse_layers=True)

    if smallest != batch_size:
        slice_batch(example_inputs, batch_size, smallest)  # a clear error before any export
    pending = start_capture(capture_at, smallest, jobs=jobs) if smallest != batch_size else None
    try:
        graph = capture(model, example_inputs, tracer=tracer, reuse_layers=True)
        low = pending.result() if pending is not None else None
    finally:
        if pending is not None:
            pending.close()
    return MicrobatchGraphs(
        full=graph, batch_size=batch_size, smallest=smallest, capture_at=capture_at, smallest_graph=low
    )


def slice_batch(example_inputs: Sequence[Any], batch_size: int, size: int) -> tuple[Any, ...]:
    """The example inputs at batch ``size``: tensors whose dim 0 is the batch are cut to ``size`` rows."""
    sliced = [
        x[:size] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size else x for x in example_inputs
    ]
    if size != batch_size and not any(
        isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size for x in example_inputs
    ):
        raise AutoplanError(f"no example input has the batch ({batch_size}) as dim 0: use --microbatches 1")
    return tuple(sliced)
