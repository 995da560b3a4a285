"""Bytes one device of a stage holds at its fullest: model state, what the executor holds, and the activations'
timeline (:mod:`cost_models.memory_timeline`).

:func:`stage_memory_bytes` adds up (:class:`StageMemory`)::

    memory = state + held + max((in_flight − 1) · kept + peak, end + sync)

* ``state``: weights and optimizer state at their shard counts (:func:`cost_models.memory.model_state_bytes`),
  and the gradients when they outlive one microbatch's backward (``m > 1``: the first backward makes them);
  with one microbatch the gradients are made during the backward and the timeline charges them as they are;
* ``held``: DDP's gradient buckets (pure data parallelism over several devices: DDP, with
  ``gradient_as_bucket_view=False``, torch's default, copies every gradient into a bucket of its own and
  keeps the buckets for the whole run: :func:`ddp_bucket_bytes`, one more gradient's worth); FSDP's gathered
  layer groups and the unsharded gradients of the group being reduced (:func:`fsdp_held_bytes`);
* ``kept`` and ``peak``: one microbatch's activations between its forward and backward, and the most it holds
  at once — its saved tensors, transients, activation gradients, the loss's tensors and its parameters'
  gradients as the backward makes them (:func:`cost_models.memory_timeline.activation_peak` on the stage's
  tape, :func:`stage_tape`); ``in_flight`` microbatches of a pipeline stage keep theirs while one peaks
  (``min(S − s, m)`` under 1F1B, ``m`` under GPipe);
* ``end + sync``: when the last backward ends, what its microbatch still holds (its parameters' gradients with
  one microbatch, the stage's inputs and outputs) and, on a sharded stage, the gradient buckets it flattens to
  all-reduce the partial sums (:mod:`executors.parallel.grad_sync`: each bucket's local gradients copied into one flat
  tensor while the gradients themselves live on until the reduced bucket replaces them), one more copy of every
  gradient that syncs over a mesh axis.

The tape (:func:`stage_tape`) charges each operator at its local size (:class:`NodeBytes`): its outputs, its
dropout mask, a max pooling's int64 indices (:func:`cost_models.memory.index_bytes`), an RNN's per-step gates
(:func:`cost_models.memory.rnn_kept_bytes`), and on a sharded stage the resharded copy of an input whose
producer's spec differs from the one it reads (DTensor redistributes into a new tensor: kept when the operator
saves that input, a transient otherwise). Views and in-place operators alias their input
(:func:`cost_models.memory.aliases_input`), but on a DTensor stage of several devices the tensor-parallel executor
writes an in-place operator into a copy of its input. Stage inputs are held until the stage's backward ends (the batch;
a pipeline stage's received activations, whose gradients it sends back), and so are its outputs (the runner
keeps them to call backward on; a sharded output is gathered whole first, or to the shard it crosses a pipeline
boundary in, :func:`stage_tape`'s ``gathered_output_bytes``). The last stage runs the loss on its outputs
(:func:`loss_bytes`). Recomputed runs keep only what enters them; their activations come back for the backward of the
run's last node (``backward_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cost_models.memory import (
    aliases_input,
    attention_dropout_bytes,
    dropout_mask,
    index_bytes,
    kept_under_recompute,
    rnn_kept_bytes,
    saved_inputs,
    saves_output,
)
from cost_models.memory_timeline import Tape, TapeOp, TimelinePeak, activation_peak
from planner.ir.graph import OpGraph, OpNode, TensorMeta, ValueKind


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeBytes:
    """A node's tensors on one device (:func:`stage_tape`)."""

    output: float  # its outputs at their local sizes
    share: float = 1.0  # the fraction of the node's whole tensors the device holds (its local output / whole)
    mask: float = 0.0  # a dropout's mask at its local size
    param_grads: float = 0.0  # gradients of the parameters it holds, made in its backward (0: already there)
    copies: Mapping[int, float] = field(default_factory=dict)  # input position -> resharded copy it reads
    transient: float = 0.0  # held while it runs, forward and backward (FSDP's gathered parameters)
    backward: float = 0.0  # held while its backward runs (FSDP's unsharded gradients of its group)


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """The parts of a stage's memory per device (module docstring)."""

    state_bytes: float
    held_bytes: float = 0.0
    kept_bytes: float = 0.0
    peak_bytes: float = 0.0
    in_flight: int = 1
    end_bytes: float = 0.0  # what the last microbatch still holds when its backward ends
    sync_bytes: float = 0.0  # the gradient buckets a sharded stage flattens at the end of its last backward

    @property
    def total_bytes(self) -> float:
        during = (self.in_flight - 1) * self.kept_bytes + self.peak_bytes
        return self.state_bytes + self.held_bytes + max(during, self.end_bytes + self.sync_bytes)


def stage_memory_bytes(memory: StageMemory) -> float:
    return memory.total_bytes


def aliases(node: OpNode, *, inplace_copies: bool) -> bool:
    """Whether ``node`` allocates nothing: :func:`cost_models.memory.aliases_input`, except that the tensor-parallel
    executor writes an in-place operator into a copy of its DTensor input (``inplace_copies``: a stage of several
    devices on DTensors)."""
    if not aliases_input(node):
        return False
    name = node.op_name
    return not (inplace_copies and name.endswith("_") and not name.startswith("_"))


def base_resolver(graph: OpGraph, *, inplace_copies: bool = False) -> Callable[[str], str]:
    """Value name -> the value whose memory it is (views and in-place operators resolved to what they alias)."""
    base: dict[str, str] = {}
    for node in graph.nodes:
        if aliases(node, inplace_copies=inplace_copies):
            source = node.inputs[0]
            base[node.name] = base.get(source, source)
    return lambda name: base.get(name, name)


def stage_tape(
    graph: OpGraph,
    node_bytes: Mapping[str, NodeBytes],
    *,
    grads: frozenset[str],
    inputs: Mapping[str, float],
    input_grads: Mapping[str, float] | None = None,
    loss_bytes: float = 0.0,
    gathered_output_bytes: float = 0.0,
    runs: tuple[tuple[str, ...], ...] = (),
    activation_itemsize: int | None = None,
    fused: bool = True,
    inplace_copies: bool = False,
) -> Tape:
    """The tape of ``graph`` (a stage at the microbatch size; module docstring); ``grads``: values whose gradient
    is computed; ``inputs``: the stage inputs it holds (bytes); ``gathered_output_bytes``: the whole outputs the
    runner gathers from sharded ones; ``runs``: recomputed runs of nodes; ``fused``: the device has fused dropout
    and attention-dropout kernels (a GPU; :func:`cost_models.memory.attention_dropout_bytes`); ``inplace_copies``:
    in-place operators write into a copy (a DTensor stage of several devices)."""
    base = base_resolver(graph, inplace_copies=inplace_copies)
    kept = kept_under_recompute(graph, runs) if runs else None
    run_inputs = _run_inputs(graph, runs) if runs else {}
    ops: list[TapeOp] = []
    for node in graph.nodes:
        if aliases(node, inplace_copies=inplace_copies):
            ops.append(TapeOp(name=node.name, reads=(base(node.inputs[0]),)))
            continue
        sizes = node_bytes[node.name]
        recomputed = kept is not None and node.name in kept.recomputed
        ops.append(
            _tape_op(
                graph,
                node,
                sizes,
                base=base,
                grads=grads,
                recomputed=recomputed,
                entering=run_inputs.get(node.name, ()),
                itemsize=activation_itemsize,
                fused=fused,
            )
        )
    if runs:
        ops = _with_recomputed_runs(ops, graph, runs, node_bytes, base=base, itemsize=activation_itemsize, fused=fused)
    outputs = tuple(dict.fromkeys(base(name) for name in graph.outputs))
    if gathered_output_bytes and ops:  # the last operator also keeps the whole outputs the runner gathers
        ops[-1] = replace(ops[-1], kept_bytes=ops[-1].kept_bytes + gathered_output_bytes)
    return Tape(
        ops=tuple(ops), inputs=dict(inputs), input_grads=dict(input_grads or {}), outputs=outputs, loss_bytes=loss_bytes
    )


def _tape_op(
    graph: OpGraph,
    node: OpNode,
    sizes: NodeBytes,
    *,
    base: Callable[[str], str],
    grads: frozenset[str],
    recomputed: bool,
    entering: Sequence[str],
    itemsize: int | None,
    fused: bool,
) -> TapeOp:
    """One operator's tape entry: what it reads, keeps and allocates (module docstring)."""
    saved_positions = set(saved_inputs(node))
    saves: list[str] = []
    own = index_bytes(node) + rnn_kept_bytes(node, activation_itemsize=itemsize)
    kept = sizes.mask + sizes.share * (own + attention_dropout_bytes(node, fused=fused, itemsize=itemsize))
    transient = 0.0
    reads = []
    for position, value in enumerate(node.inputs):
        if graph.value_kind(value) in (ValueKind.PARAM, ValueKind.BUFFER):
            continue
        reads.append(base(value))
        copy = sizes.copies.get(position, 0.0)
        if position in saved_positions and not recomputed:
            if copy:
                kept += copy
            else:
                saves.append(base(value))
        else:
            transient += copy
    if saves_output(node) and not recomputed:
        saves.append(node.name)
    saves += [base(value) for value in entering]
    if recomputed:  # its forward runs again in backward: it keeps nothing from the first one
        kept = 0.0
    transient += sizes.transient
    grad = sizes.output if node.name in grads and node.output.is_floating else 0.0
    return TapeOp(
        name=node.name,
        output_bytes=sizes.output,
        grad_bytes=grad,
        reads=tuple(dict.fromkeys(reads)),
        saves=tuple(dict.fromkeys(saves)),
        kept_bytes=kept,
        transient_bytes=transient,
        param_grad_bytes=sizes.param_grads,
        backward_bytes=sizes.backward,
    )


def _run_inputs(graph: OpGraph, runs: tuple[tuple[str, ...], ...]) -> dict[str, tuple[str, ...]]:
    """Per node of a recomputed run, the values entering the run it reads (what ``torch.utils.checkpoint`` keeps)."""
    found: dict[str, tuple[str, ...]] = {}
    for run in runs:
        members = set(run)
        for name in run:
            entering = [
                v
                for v in graph.node(name).inputs
                if v not in members and graph.value_kind(v) not in (ValueKind.PARAM, ValueKind.BUFFER)
            ]
            if entering:
                found[name] = tuple(entering)
    return found


def _with_recomputed_runs(
    ops: list[TapeOp],
    graph: OpGraph,
    runs: tuple[tuple[str, ...], ...],
    node_bytes: Mapping[str, NodeBytes],
    *,
    base: Callable[[str], str],
    itemsize: int | None,
    fused: bool,
) -> list[TapeOp]:
    """Each run's activations, recomputed, at the backward of its last node: what the run's nodes would keep."""
    index = {op.name: k for k, op in enumerate(ops)}
    grads: frozenset[str] = frozenset()
    for run in runs:
        members = set(run)
        again = 0.0
        saved_here: set[str] = set()
        for name in run:
            node = graph.node(name)
            if aliases_input(node):
                continue
            entry = _tape_op(
                graph,
                node,
                node_bytes[name],
                base=base,
                grads=grads,
                recomputed=False,
                entering=(),
                itemsize=itemsize,
                fused=fused,
            )
            again += entry.kept_bytes
            saved_here.update(value for value in entry.saves if value in members)
        again += sum(node_bytes[name].output for name in saved_here if name in node_bytes)
        last = index[run[-1]]
        ops[last] = replace(ops[last], backward_bytes=ops[last].backward_bytes + again)
    return ops


def tape_peak(tape: Tape) -> TimelinePeak:
    return activation_peak(tape)


def grad_values(graph: OpGraph, *, also: frozenset[str] = frozenset()) -> frozenset[str]:
    """Values whose gradient is needed: the parameters, ``also`` (a pipeline stage's received activations) and
    every floating value computed from one."""
    needs = {p.name for p in graph.params} | set(also)
    for node in graph.nodes:
        if node.output.is_floating and any(name in needs for name in node.inputs):
            needs.add(node.name)
    return frozenset(needs)


def whole_bytes(node: OpNode, itemsize: int | None) -> float:
    """All of a node's outputs, whole (floating ones at the activation itemsize)."""
    return float(sum(m.numel * itemsize if itemsize and m.is_floating else m.nbytes for m in node.outputs))


def param_owners(graph: OpGraph) -> dict[str, list[str]]:
    """Node -> the parameters it is the first reader of (the node whose backward makes their gradient first)."""
    owners: dict[str, list[str]] = {}
    seen: set[str] = set()
    for node in graph.nodes:
        for value in node.inputs:
            if graph.value_kind(value) == ValueKind.PARAM and value not in seen:
                seen.add(value)
                owners.setdefault(node.name, []).append(value)
    return owners


def replica_node_bytes(
    graph: OpGraph,
    *,
    batched: set[str],
    num_batch_shards: int,
    activation_itemsize: int | None,
    param_grad_bytes: float,
    fused: bool = True,
) -> dict[str, NodeBytes]:
    """Each node on one data-parallel replica: its batch-carrying tensors split ``num_batch_shards`` ways; its
    parameters' gradients (``param_grad_bytes`` per parameter element; 0: already in the state) made in its
    backward."""
    owners = param_owners(graph)
    found = {}
    for node in graph.nodes:
        share = 1.0 / num_batch_shards if node.name in batched else 1.0
        mask = dropout_mask(node, fused=fused)
        numel = sum(graph.value(name).meta.numel for name in owners.get(node.name, ()))
        found[node.name] = NodeBytes(
            output=whole_bytes(node, activation_itemsize) * share,
            share=share,
            mask=mask.nbytes * share if mask is not None else 0.0,
            param_grads=numel * param_grad_bytes,
        )
    return found


def loss_bytes(graph: OpGraph, *, per_output_element: float, share: float = 1.0) -> float:
    """What the loss holds at its peak (:mod:`cost_models.loss_memory`): its bytes per element of the floating
    outputs it reads, times their elements (``share`` of them: one replica's rows)."""
    elements = sum(_meta(graph, name).numel for name in graph.outputs if _meta(graph, name).is_floating)
    return per_output_element * elements * share


def _meta(graph: OpGraph, name: str) -> TensorMeta:
    return graph.node(name).output if graph.has_node(name) else graph.value(name).meta
