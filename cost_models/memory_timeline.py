"""The most bytes one microbatch holds at once through a stage's forward, the loss and the backward.

A stage's operators run as a *tape* (:class:`TapeOp`, forward order ``k = 0 … n−1``) and then backward in
reverse. :func:`activation_peak` follows every block of memory the microbatch allocates over the timeline
``t = 0 … 2n``: forward of op ``k`` at ``t = k``, the loss at ``t = n``, backward of op ``k`` at ``t = 2n − k``,
and returns the largest sum (:class:`TimelinePeak`). With ``p(v)`` the op producing value ``v`` (−1: a stage
input), ``L(v)`` its last forward reader, ``S(v)`` the first op (forward order) that keeps it for backward and
``G(v)`` its last reader (the loss, ``n``, for a stage output), the blocks are

* a value's output bytes ``b(v)``, alive from ``t = p(v)`` to ``L(v)`` when nothing keeps it, to ``2n − S(v)`` when
  an op keeps it for backward (autograd frees a saved tensor with the last backward that reads it), to ``2n``
  for a stage output (the runner holds it until the backward ends) and for a stage input (the batch, or what
  the previous stage sent, kept for its gradient);
* what an op keeps beyond its output (``TapeOp.kept_bytes``: a dropout mask, pooling indices, an RNN's
  per-step gates, a resharded copy of an input it saves), from ``t = k`` to ``2n − k``;
* a value's gradient ``g(v)``, created by the backward of ``G(v)`` and freed after the backward of its producer:
  from ``2n − G(v)`` to ``2n − p(v)`` (a stage input's until the end: it is sent back; a stage output's from
  ``n + 1``: at ``n`` it is part of the loss's bytes);
* an op's parameter gradients, from its backward to the step's end (``param_grad_bytes``; zero when they
  already exist, from an earlier microbatch);
* an op's transients (``transient_bytes``: a workspace, a resharded copy it does not keep, a collective's
  buffer) at ``t = k`` and again at ``t = 2n − k``; what only its backward holds (``backward_bytes``: a
  recomputed run's activations, charged at the run's last op) at ``t = 2n − k``; and the loss's own
  tensors (``Tape.loss_bytes``: its saved tensors and the gradient it hands back, :mod:`cost_models.loss_memory`)
  at ``t = n``.

Views and in-place operators allocate nothing: the tape's builder resolves them to the value they alias. A
gradient that an operator passes through unchanged (an addition's) is charged as its own block, an
over-count of at most one activation-sized tensor at a time. ``TimelinePeak.kept_bytes`` is what the
microbatch holds between its forward and its backward (everything alive at ``t = n`` but the loss's
tensors): what each *other* microbatch in flight holds while this one peaks
(:func:`planner.costing.stage_memory.stage_memory_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class TapeOp:
    """One operator of a stage, in forward order (module docstring)."""

    name: str  # the value it produces
    output_bytes: float = 0.0  # bytes its output allocates (0: a view or an in-place operator)
    grad_bytes: float = 0.0  # bytes of its output's gradient in backward (0: none flows)
    reads: tuple[str, ...] = ()  # values it reads in forward
    saves: tuple[str, ...] = ()  # values its backward reads (its own name when it keeps its output)
    kept_bytes: float = 0.0  # bytes it allocates in forward and keeps for its backward, beyond its output
    transient_bytes: float = 0.0  # bytes it holds only while it runs (forward, and again backward)
    param_grad_bytes: float = 0.0  # its parameters' gradients, made in its backward, kept to the step's end
    backward_bytes: float = 0.0  # bytes held only while its backward runs (a recomputed run's activations)


@dataclass(frozen=True, kw_only=True)
class Tape:
    """A stage's operators for one microbatch and what surrounds them."""

    ops: tuple[TapeOp, ...]
    inputs: Mapping[str, float] = field(default_factory=dict)  # stage inputs (bytes), held from the start
    input_grads: Mapping[str, float] = field(default_factory=dict)  # their gradients' bytes (0: none)
    outputs: tuple[str, ...] = ()  # values that leave the stage, held until its backward ends
    loss_bytes: float = 0.0  # the loss's own tensors at its peak (the last stage's), at t = n


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelinePeak:
    peak_bytes: float  # the most the microbatch holds at once
    kept_bytes: float  # what it holds between its forward and its backward
    at: int  # the timeline position of the peak (module docstring)
    end_bytes: float = 0.0  # what it still holds when its backward ends (parameter gradients, held inputs, outputs)

    def phase(self, num_ops: int) -> str:
        return "forward" if self.at < num_ops else "loss" if self.at == num_ops else "backward"


def activation_peak(tape: Tape) -> TimelinePeak:
    """The timeline's largest sum and the bytes kept between forward and backward (module docstring)."""
    n = len(tape.ops)
    end = 2 * n
    delta = [0.0] * (end + 2)
    point = [0.0] * (end + 1)

    def span(first: int, last: int, num_bytes: float) -> None:
        if num_bytes and last >= first:
            delta[first] += num_bytes
            delta[last + 1] -= num_bytes

    producer = {name: -1 for name in tape.inputs}
    last_read: dict[str, int] = {}
    first_saver: dict[str, int] = {}
    grad_from: dict[str, int] = {name: n for name in tape.outputs}
    for k, op in enumerate(tape.ops):
        producer[op.name] = k
        for value in op.reads:
            last_read[value] = k
            grad_from[value] = max(grad_from.get(value, k), k)
        for value in op.saves:
            first_saver.setdefault(value, k)
    held = set(tape.outputs) | set(tape.inputs)
    for num_bytes in tape.inputs.values():
        span(0, end, num_bytes)
    kept_at_loss = sum(tape.inputs.values())
    for k, op in enumerate(tape.ops):
        name = op.name
        if name in held:
            last = end
        elif name in first_saver:
            last = end - first_saver[name]
        else:
            last = max(k, last_read.get(name, k))
        span(k, last, op.output_bytes)
        kept_at_loss += op.output_bytes if last >= n else 0.0
        span(k, end - k, op.kept_bytes)
        kept_at_loss += op.kept_bytes
        span(end - k, end, op.param_grad_bytes)
        if name in grad_from:
            span(_grad_start(grad_from[name], n), end - k, op.grad_bytes)
        point[k] += op.transient_bytes
        point[end - k] += op.transient_bytes + op.backward_bytes
    for name, num_bytes in tape.input_grads.items():
        if name in grad_from:
            span(_grad_start(grad_from[name], n), end, num_bytes)
    point[n] += tape.loss_bytes
    live, best, at = 0.0, 0.0, 0
    for t in range(end + 1):
        live += delta[t]
        if live + point[t] > best:
            best, at = live + point[t], t
    return TimelinePeak(peak_bytes=best, kept_bytes=kept_at_loss, at=at, end_bytes=live)


def _grad_start(reader: int, num_ops: int) -> int:
    """When a value's gradient is made: in the backward of its last reader, ``2n − reader``; a stage output's by
    the loss (counted in ``Tape.loss_bytes`` at ``t = n``), so from ``n + 1``."""
    return num_ops + 1 if reader >= num_ops else 2 * num_ops - reader
