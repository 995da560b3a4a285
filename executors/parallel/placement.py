"""Op placements (``dataflow`` plans) -> point-to-point sends between per-node autograd graphs.

A placement plan (hash, critical-path, multi-objective, m-etf, rl) puts every node of the graph
captured at the microbatch size ``B/m`` on one rank: one ``(1,)`` stage per used rank, its
``nodes`` in any pattern (a node's producers may live anywhere, placements may ping-pong), its
``param_placements`` the parameters it reports. Every rank holds the whole model.

**Tasks.** The global walk is ``graph.nodes`` in topological order followed by one loss task
``L = loss_fn(model_output(graph, outputs), inputs) / m`` on the rank of the last output's producer.
Every rank walks the same tasks in the same order (forward: microbatches ``0..m-1``, tasks in
order; backward: microbatches ``m-1..0``, tasks reversed) and does only its share of each.

**Forward.** The owner runs a node on *leaves*: a value produced on this rank is read through
``out.detach().requires_grad_()`` (one leaf per value and microbatch, shared by all local readers),
a value from another rank arrives in a fresh leaf, parameters and buffers are the model's own
tensors, graph inputs the microbatch's rows. So every node is its own little autograd graph
``out_n = f_n(leaves_n)``. The owner then ``isend``s each tensor of ``out_n`` once to every other rank
that reads it; at the same point of the walk each such rank posts the matching ``irecv`` into a
buffer shaped by the node's ``TensorMeta``, and waits on it only when its first reader runs.

**Backward.** The chain rule through the cut graphs: for value ``v`` with readers ``c``,
``dL/dv = Σ_c (∂out_c/∂v)ᵀ dL/dout_c``. A local reader's term accumulates in the shared leaf's
``.grad``; a rank ``r ≠ owner(v)`` sums its readers' terms in its received leaf and, right after the
backward of its *first* (in forward order) reader of ``v`` — its last in the reversed walk — sends
that sum to ``v``'s owner, which posts the matching ``irecv`` at the same point and waits when it
reaches ``v``: ``grad_v = leaf.grad + Σ_r received_r``, then ``torch.autograd.backward(out_v, grad_v)``.
Gradients travel only for floating tensors of values that depend on a trainable parameter
(static, so both sides agree; zeros when a reader produced none). Parameters are leaves
themselves, so ``p.grad = Σ_microbatches ∂(L_i/m)/∂p`` accumulates where ``p`` is read.

**Parameters.** ``p`` is *held* by its owner stage and by every rank that reads it. A parameter
held by several ranks (tied embeddings) has its gradient all-reduced over the default group
(others add zeros) so every holder gets the whole sum; ``parameters()`` returns every held
parameter, so identical copies take identical optimizer steps. ``gradients()`` reports owned ones.

**Deadlock freedom.** Sends and receives are non-blocking and are issued at the same walk
position on both sides, in the same order for every pair of ranks, so gloo's (source, tag)
matching and NCCL's issue-order matching pair them alike. A rank only blocks in ``wait`` on a
message issued at an earlier position; the rank furthest behind therefore never waits on anyone
behind it, and every rank makes progress. Microbatches pipeline on their own: a rank runs ahead
into the next microbatch until it needs a value that is not there yet.

Limits: buffers mutated by the forward (batch-norm statistics) update only the local copy, and an
in-place operator mutates a clone of its first input (later readers of the original name see the
old value; exported graphs are functional, so this does not arise there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from executors.graph_module import call_node_plain, model_output, model_tensors, output_names
from executors.session import Workload, split_batch
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph, TensorMeta, op_base_name
from planner.ir.node_call import is_inplace, torch_dtype
from planner.plan import Plan

LOSS = "<loss>"
Incoming = tuple[list[Tensor], list[dist.Work]]


@dataclass(frozen=True, kw_only=True)
class Task:
    """One position of the global walk: a graph node, or the loss after the last node."""

    name: str
    inputs: tuple[str, ...]
    owner: int


@dataclass(frozen=True, kw_only=True)
class Routes:
    """Who computes what and which messages go where; the same on every rank."""

    tasks: tuple[Task, ...]
    producer: dict[str, int]  # node -> rank that runs it
    readers: dict[str, tuple[int, ...]]  # node -> other ranks that read its output (forward sends)
    grad_elements: dict[str, tuple[int, ...]]  # node -> indices of its output tensors that get gradients
    grad_sends: dict[str, tuple[tuple[str, int], ...]]  # task -> (value, producer rank) sent after its backward
    holders: dict[str, frozenset[int]]  # parameter -> ranks that keep a live copy (owner and readers)
    loss_rank: int


def node_owners(plan: Plan, graph: OpGraph) -> dict[str, int]:
    """Node -> rank, checking the plan is a placement: one device per stage, every node once."""
    owner: dict[str, int] = {}
    for stage in plan.stages:
        if len(stage.devices) != 1:
            raise AutoplanError(f"a dataflow plan needs one device per stage; stage {stage.index} has {stage.devices}")
        for name in stage.nodes:
            if name in owner:
                raise AutoplanError(f"node {name} is placed on both rank {owner[name]} and rank {stage.devices[0]}")
            owner[name] = stage.devices[0]
    missing = [node.name for node in graph.nodes if node.name not in owner]
    if missing:
        raise AutoplanError(f"{len(missing)} nodes have no device in the plan (e.g. {missing[0]}): re-plan the model")
    return owner


def gradient_elements(graph: OpGraph, trainable: set[str]) -> dict[str, tuple[int, ...]]:
    """Node -> its floating output tensors, when the node depends on a trainable parameter."""
    needs, elements = set(trainable), {}
    for node in graph.nodes:
        found = any(name in needs for name in node.inputs)
        elements[node.name] = tuple(i for i, meta in enumerate(node.outputs) if found and meta.is_floating)
        if elements[node.name]:
            needs.add(node.name)
    return elements


def build_routes(plan: Plan, graph: OpGraph, *, trainable: set[str]) -> Routes:
    producer = node_owners(plan, graph)
    last = graph.outputs[-1] if graph.outputs else ""
    loss_rank = producer.get(last, plan.stages[0].devices[0])  # the last output's producer computes the loss
    tasks = tuple(Task(name=n.name, inputs=n.inputs, owner=producer[n.name]) for n in graph.nodes)
    tasks += (Task(name=LOSS, inputs=output_names(graph), owner=loss_rank),)
    elements = gradient_elements(graph, trainable)
    readers: dict[str, set[int]] = {}
    first_read: dict[tuple[str, int], str] = {}
    holders: dict[str, set[int]] = {name: set() for name in graph.param_names}
    for stage in plan.stages:
        for name in stage.param_placements:
            holders.setdefault(name, set()).add(stage.devices[0])
    for task in tasks:
        for value in dict.fromkeys(task.inputs):
            if value in holders:
                holders[value].add(task.owner)
            elif value in producer and producer[value] != task.owner:
                readers.setdefault(value, set()).add(task.owner)
                first_read.setdefault((value, task.owner), task.name)
    sends: dict[str, list[tuple[str, int]]] = {}
    for (value, _), task_name in first_read.items():
        if elements[value]:
            sends.setdefault(task_name, []).append((value, producer[value]))
    for value, ranks in readers.items():
        if not graph.node(value).outputs:
            raise AutoplanError(f"node {value} returns no tensor but is read on rank {min(ranks)}: cannot send it")
    return Routes(
        tasks=tasks,
        producer=producer,
        readers={v: tuple(sorted(r)) for v, r in readers.items()},
        grad_elements=elements,
        grad_sends={t: tuple(s) for t, s in sends.items()},
        holders={name: frozenset(ranks) for name, ranks in holders.items()},
        loss_rank=loss_rank,
    )


@dataclass(kw_only=True)
class Microbatch:
    """One microbatch's state on this rank, from its forward until its backward is done."""

    piece: tuple[Any, ...]
    inputs: dict[str, Tensor]
    values: dict[str, Any] = field(default_factory=dict)  # value -> the leaf (or leaves) local readers use
    outputs: dict[str, Any] = field(default_factory=dict)  # own node -> its result, attached to its graph
    incoming: dict[str, Incoming] = field(default_factory=dict)  # value in flight from its producer
    grads_in: dict[str, list[Incoming]] = field(default_factory=dict)  # own node -> gradients in flight
    loss: Tensor | None = None


def used_outputs(graph: OpGraph) -> dict[str, frozenset[int]]:
    """Per node, the positions of its outputs some node reads: a tuple's unread parts (embedding_bag's
    offsets, whose sizes the meta kernel may not predict) are never sent."""
    used: dict[str, set[int]] = {node.name: set() for node in graph.nodes}
    read = {value for node in graph.nodes for value in node.inputs} | set(graph.outputs)
    for node in graph.nodes:
        for position, name in enumerate(node.inputs):
            if name not in used:
                continue
            many = len(graph.node(name).outputs) > 1
            if many and op_base_name(node.target) == "getitem" and position == 0 and isinstance(node.args[1], int):
                if node.name in read:  # a getitem nobody reads (export keeps one per output) reads nothing
                    used[name].add(node.args[1])
            else:
                used[name].update(range(len(graph.node(name).outputs)))
    for name in graph.outputs:
        if name in used:
            used[name].update(range(len(graph.node(name).outputs)))
    return {name: frozenset(indexes) for name, indexes in used.items()}


def tensors_of(value: Any) -> list[Tensor]:
    return [x for x in tree_flatten(value)[0] if isinstance(x, Tensor)]


def local_leaf(value: Any) -> Any:
    return value.detach().requires_grad_(value.requires_grad) if isinstance(value, Tensor) else value


class PlacementRunner:
    def __init__(self, *, plan: Plan, workload: Workload, model: nn.Module) -> None:
        if plan.batch_size % plan.num_microbatches:
            raise AutoplanError(f"{plan.num_microbatches} microbatches do not divide the batch {plan.batch_size}")
        self.plan, self.workload, self.device = plan, workload, workload.device
        self.m = plan.num_microbatches
        self.graph = workload.graph_at(plan.batch_size // self.m)
        self.rank = dist.get_rank()
        self.params, self.buffers = model_tensors(model)
        trainable = {name for name, p in self.params.items() if p.requires_grad}
        self.routes = build_routes(plan, self.graph, trainable=trainable)
        self.held = tuple(name for name, ranks in self.routes.holders.items() if self.rank in ranks)
        self.shared = tuple(n for n, ranks in self.routes.holders.items() if len(ranks) > 1 and n in trainable)
        self.owned = tuple(n for stage in plan.stages if stage.devices[0] == self.rank for n in stage.param_placements)
        self.input_names = tuple(value.name for value in self.graph.inputs)
        self.used_outputs = used_outputs(self.graph)
        self._sending: list[tuple[Tensor, dist.Work]] = []

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank keeps a copy of (none on an idle rank)."""
        return [self.params[name] for name in self.held]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {name: self.params[name] for name in self.held}

    def step(self, inputs: tuple[Any, ...]) -> float:
        pieces = split_batch(inputs, num_chunks=self.m, batch_size=self.plan.batch_size)
        micros = [self._microbatch(piece) for piece in pieces]
        for micro in micros:
            for task in self.routes.tasks:
                self._forward(task, micro)
        total = torch.zeros((), device=self.device)
        for micro in micros:
            total += micro.loss.detach() if micro.loss is not None else 0.0
        while micros:
            micro = micros.pop()
            for task in reversed(self.routes.tasks):
                self._backward(task, micro)
        self._drain()
        self._sum_shared_grads()
        dist.broadcast(total, src=self.routes.loss_rank)
        return float(total)

    def gradients(self) -> dict[str, torch.Tensor]:
        return {name: self.params[name].grad for name in self.owned if self.params[name].grad is not None}

    def _microbatch(self, piece: tuple[Any, ...]) -> Microbatch:
        tensors = [x for x in self.workload.model_inputs(piece) if isinstance(x, Tensor)]
        return Microbatch(piece=piece, inputs=dict(zip(self.input_names, tensors, strict=True)))

    # forward

    def _forward(self, task: Task, micro: Microbatch) -> None:
        if task.owner == self.rank:
            self._run(task, micro)
        elif self.rank in self.routes.readers.get(task.name, ()):
            used = self.used_outputs[task.name]
            metas = [m if i in used else None for i, m in enumerate(self.graph.node(task.name).outputs)]
            micro.incoming[task.name] = self._post_recv(task.owner, metas)

    def _run(self, task: Task, micro: Microbatch) -> None:
        args = [self._read(name, micro) for name in task.inputs]
        if task.name == LOSS:
            micro.loss = self.workload.loss(model_output(self.graph, args), micro.piece) / self.m
            return
        node = self.graph.node(task.name)
        if is_inplace(node.target) and args and isinstance(args[0], Tensor):
            args[0] = args[0].clone()  # an in-place op may not write into a leaf that requires grad
        out = call_node_plain(node, args, device=self.device)
        micro.outputs[task.name] = out
        micro.values[task.name] = tree_map(local_leaf, out)
        readers = self.routes.readers.get(task.name, ())
        if readers:
            used = self.used_outputs[task.name]
            produced = [t for i, t in enumerate(tensors_of(out)) if i in used]
            self._check_metas(task.name, produced)
            for rank in readers:
                for tensor in produced:
                    self._send(tensor, rank)

    def _read(self, name: str, micro: Microbatch) -> Any:
        if name in micro.values:
            return micro.values[name]
        if name in micro.incoming:
            buffers, works = micro.incoming.pop(name)
            for work in works:
                work.wait()
            for index in self.routes.grad_elements[name]:
                buffers[index].requires_grad_()
            micro.values[name] = buffers[0] if len(buffers) == 1 else tuple(buffers)
            return micro.values[name]
        if name in self.params:
            return self.params[name]
        if name in self.buffers:
            return self.buffers[name]
        return micro.inputs[name]

    def _check_metas(self, name: str, produced: list[Tensor]) -> None:
        used = self.used_outputs[name]
        expected = [tuple(meta.shape) for i, meta in enumerate(self.graph.node(name).outputs) if i in used]
        if [tuple(t.shape) for t in produced] != expected:
            raise AutoplanError(
                f"node {name} produced shapes {[tuple(t.shape) for t in produced]}, the graph says {expected}: "
                "the model's graph depends on more than the batch size; re-plan with --microbatches 1"
            )

    # backward

    def _backward(self, task: Task, micro: Microbatch) -> None:
        sends = self.routes.grad_sends.get(task.name, ())
        if task.owner == self.rank:
            if task.name == LOSS:
                if micro.loss is not None and micro.loss.requires_grad:
                    micro.loss.backward()
            else:
                self._backward_node(task.name, micro)
            for value, producer in sends:
                self._send_grads(value, micro.values[value], producer)
            return
        node_outputs = {value: self.graph.node(value).outputs for value, producer in sends if producer == self.rank}
        for value, outputs in node_outputs.items():
            metas = [outputs[i] for i in self.routes.grad_elements[value]]
            micro.grads_in.setdefault(value, []).append(self._post_recv(task.owner, metas))

    def _backward_node(self, name: str, micro: Microbatch) -> None:
        outs = tensors_of(micro.outputs.pop(name))
        grads: list[Tensor | None] = [leaf.grad for leaf in tensors_of(micro.values.pop(name))]
        for buffers, works in micro.grads_in.pop(name, []):
            for work in works:
                work.wait()
            for index, grad in zip(self.routes.grad_elements[name], buffers, strict=True):
                grads[index] = grad if grads[index] is None else grads[index] + grad
        pairs = [
            (out, grad.to(out.dtype))
            for out, grad in zip(outs, grads, strict=True)
            if grad is not None and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])

    def _send_grads(self, value: str, leaves: Any, producer: int) -> None:
        tensors = tensors_of(leaves)
        outputs = self.graph.node(value).outputs
        for index in self.routes.grad_elements[value]:
            grad = tensors[index].grad
            if grad is None:  # zeros of the output's own shape (an unread output is only a placeholder here)
                meta = outputs[index]
                grad = torch.zeros(meta.shape, dtype=torch_dtype(meta.dtype), device=self.device)
            self._send(grad, producer)

    # communication

    def _send(self, tensor: Tensor, dst: int) -> None:
        payload = tensor.detach().to(self.workload.precision.wire_dtype(tensor.dtype)).contiguous()
        self._sending.append((payload, dist.isend(payload, dst=dst)))

    def _post_recv(self, src: int, metas: tuple[TensorMeta, ...] | list[TensorMeta | None]) -> Incoming:
        """Receive buffers for ``metas``; a None (an output nobody reads) is an empty placeholder, not sent."""
        wire = self.workload.precision.wire_dtype
        buffers = [
            torch.empty(
                meta.shape if meta else (0,), dtype=wire(torch_dtype(meta.dtype)) if meta else None, device=self.device
            )
            for meta in metas
        ]
        return buffers, [dist.irecv(buffer, src=src) for buffer, meta in zip(buffers, metas, strict=True) if meta]

    def _drain(self) -> None:
        for _, work in self._sending:
            work.wait()
        self._sending.clear()

    def _sum_shared_grads(self) -> None:
        """Every holder of a parameter read on several ranks gets the sum of all their gradients."""
        for name in self.shared:
            param = self.params[name]
            mine = self.rank in self.routes.holders[name] and param.grad is not None
            total = (
                param.grad.detach().clone() if mine else torch.zeros_like(param, memory_format=torch.contiguous_format)
            )
            dist.all_reduce(total)
            if self.rank in self.routes.holders[name]:
                param.grad = total
