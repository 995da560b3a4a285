"""The device-placement problem the classic baselines solve: put every operator on one device.

A :class:`PlacementProblem` is pure numbers, so the algorithms (hash, critical path,
multi-objective, m-ETF, RL) and their tests need no model:

* op ``i`` (topological order) takes ``fwd_s[i] + bwd_s[i]`` seconds per microbatch on a device of
  speed 1, and ``(fwd_s[i] + bwd_s[i]) / device_speed[d]`` on device ``d``; the optimizer update of its
  parameters takes ``step_s[i]`` once per step (no gradient sync: one copy of each weight);
  a parameter read by several ops (tied weights) is held and updated by its first reader;
* it keeps ``state_bytes[i]`` (its parameters, gradients and optimizer state) on its device for
  the whole step and ``activation_bytes[i]`` per microbatch in flight, so the memory an op needs
  is ``state + activation × num_microbatches`` (:meth:`PlacementProblem.memory_bytes`: every
  microbatch may be in flight under the dataflow schedule);
* edge ``(u, v, b)`` sends ``b`` bytes per microbatch forward (and the same back as a gradient)
  when ``u`` and ``v`` are on different devices: :meth:`PlacementProblem.transfer_s` seconds,
  ``link_latency_s[a][b] + bytes / link_bandwidth[a][b]`` (``Link.transfer_s``; 0 for no bytes or one device).
  The links are numbers, not a function, so that :mod:`~planner.baselines.placement.batched_simulator`
  can price them in compiled code exactly as the simulator does.

:func:`placement_problem` builds one from a captured graph at the microbatch size, charging
every op as the single-device intra-op problem does (:func:`planner.intra.stage_problem.build_stage_problem`
on a ``(1,)`` mesh), so a placement is costed by the same model as every other plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.cluster import Link
from cost_models.communication import p2p_s
from cost_models.compute import NodeTime
from cost_models.memory import model_state_bytes
from planner.costing.estimate import optimizer_step_s
from planner.costing.setup import CostSetup
from planner.ir.graph import OpGraph, ValueKind

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, kw_only=True)
class PlacementProblem:
    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    step_s: tuple[float, ...]
    state_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    edges: tuple[tuple[int, int, float], ...]  # (producer, consumer, bytes per microbatch), producer < consumer
    device_speed: tuple[float, ...]
    device_memory_bytes: tuple[float, ...]
    num_microbatches: int
    link_latency_s: Matrix  # [a][b]: seconds to start a transfer from device a to device b
    link_bandwidth: Matrix  # [a][b]: bytes per second from a to b (math.inf: bytes are free)
    step_overhead_s: float = 0.0  # the device's host work once per step, on every device

    def __post_init__(self) -> None:
        n = len(self.names)
        assert all(len(x) == n for x in (self.fwd_s, self.bwd_s, self.step_s, self.state_bytes, self.activation_bytes))
        assert len(self.device_speed) == len(self.device_memory_bytes) > 0
        assert all(0 <= u < v < n for u, v, _ in self.edges), "edges must go forward in topological order"
        assert self.num_microbatches >= 1
        devices = len(self.device_speed)
        for matrix in (self.link_latency_s, self.link_bandwidth):
            assert len(matrix) == devices and all(len(row) == devices for row in matrix), "links are D × D"
        assert all(b > 0 for row in self.link_bandwidth for b in row), "bandwidths must be positive"

    @property
    def num_ops(self) -> int:
        return len(self.names)

    @property
    def num_devices(self) -> int:
        return len(self.device_speed)

    def transfer_s(self, a: int, b: int, num_bytes: float) -> float:
        """Seconds to send ``num_bytes`` from device ``a`` to ``b`` (:func:`cost_models.communication.p2p_s`)."""
        if a == b:
            return 0.0
        return p2p_s(num_bytes, link=Link(bandwidth=self.link_bandwidth[a][b], latency_s=self.link_latency_s[a][b]))

    def time_s(self, op: int) -> float:
        """Forward and backward seconds of one microbatch on a device of speed 1."""
        return self.fwd_s[op] + self.bwd_s[op]

    def memory_bytes(self, op: int) -> float:
        return self.state_bytes[op] + self.activation_bytes[op] * self.num_microbatches

    def successors(self) -> list[list[tuple[int, float]]]:
        out: list[list[tuple[int, float]]] = [[] for _ in self.names]
        for u, v, num_bytes in self.edges:
            out[u].append((v, num_bytes))
        return out

    def predecessors(self) -> list[list[tuple[int, float]]]:
        into: list[list[tuple[int, float]]] = [[] for _ in self.names]
        for u, v, num_bytes in self.edges:
            into[v].append((u, num_bytes))
        return into

    def fastest_devices(self) -> list[int]:
        fastest = max(self.device_speed)
        return [d for d, speed in enumerate(self.device_speed) if speed == fastest]


def check_assignment(problem: PlacementProblem, assignment: Sequence[int]) -> None:
    """Assert ``assignment`` gives every op a device of the problem (an internal invariant)."""
    assert len(assignment) == problem.num_ops, f"{len(assignment)} devices for {problem.num_ops} ops"
    assert all(0 <= d < problem.num_devices for d in assignment), "a device outside the problem"


def device_memory_used(problem: PlacementProblem, assignment: Sequence[int]) -> list[float]:
    used = [0.0] * problem.num_devices
    for op, device in enumerate(assignment):
        used[device] += problem.memory_bytes(op)
    return used


def fits(problem: PlacementProblem, assignment: Sequence[int]) -> bool:
    used = device_memory_used(problem, assignment)
    return all(u <= cap for u, cap in zip(used, problem.device_memory_bytes, strict=True))


def uniform_links(num_devices: int, *, latency_s: float, bandwidth: float = math.inf) -> dict[str, Matrix]:
    """``link_latency_s`` and ``link_bandwidth`` with every pair of devices alike (for ``PlacementProblem(**…)``)."""
    return {
        "link_latency_s": ((latency_s,) * num_devices,) * num_devices,
        "link_bandwidth": ((bandwidth,) * num_devices,) * num_devices,
    }


def cluster_links(setup: CostSetup, devices: Sequence[int]) -> dict[str, Matrix]:
    """The links between ``devices`` (indices of the problem to cluster ranks), as the cluster gives them."""
    links = [[setup.cluster.link_between([a, b]) for b in devices] for a in devices]
    return {
        "link_latency_s": tuple(tuple(link.latency_s for link in row) for row in links),
        "link_bandwidth": tuple(tuple(link.bandwidth for link in row) for row in links),
    }


def placement_problem(
    graph: OpGraph, setup: CostSetup, *, num_microbatches: int, devices: Sequence[int] | None = None
) -> PlacementProblem:
    """The problem for ``graph`` (at the microbatch size) over ``devices`` (default: the whole cluster)."""
    from planner.intra.stage_problem import IntraOpOptions, build_stage_problem
    from planner.sharding.specs import StageMesh

    cluster = setup.cluster
    devices = tuple(range(cluster.num_devices)) if devices is None else tuple(devices)
    mesh = StageMesh(
        cluster=cluster, devices=(devices[0],), mesh_shape=(1,), activation_itemsize=setup.activation_itemsize
    )
    stage = build_stage_problem(graph, setup, mesh, IntraOpOptions(num_microbatches=num_microbatches))
    index = {name: i for i, name in enumerate(stage.variables)}
    fwd, bwd, step, state, activation = [], [], [], [], []
    held: set[str] = set()  # a parameter read by several ops (tied weights) is held by its first reader
    for node in graph.nodes:
        cost = stage.costs[index[stage.representative[node.name]]][0]
        split = _split(setup.compute.node_time(node), cost.compute_s)
        fwd.append(split[0] + cost.comm_s / 2)
        bwd.append(split[1] + cost.comm_s / 2)
        own = [
            meta.numel
            for name, meta in zip(node.inputs, node.input_metas, strict=True)
            if graph.value_kind(name) == ValueKind.PARAM and name not in held
        ]
        held.update(name for name in node.inputs if graph.value_kind(name) == ValueKind.PARAM)
        step.append(optimizer_step_s(sum(own), setup))
        state.append(float(sum(model_state_bytes(numel, optimizer=setup.optimizer) for numel in own)))
        activation.append(cost.activation_bytes)
    return PlacementProblem(
        names=tuple(node.name for node in graph.nodes),
        fwd_s=tuple(fwd),
        bwd_s=tuple(bwd),
        step_s=tuple(step),
        state_bytes=tuple(state),
        activation_bytes=tuple(activation),
        edges=tuple(_edges(graph, setup)),
        device_speed=(1.0,) * len(devices),
        device_memory_bytes=(setup.memory_budget_bytes,) * len(devices),
        num_microbatches=num_microbatches,
        **cluster_links(setup, devices),
        step_overhead_s=setup.cluster.device.step_overhead_s,
    )


def _split(time: NodeTime, compute_s: float) -> tuple[float, float]:
    total = time.total_s
    if total <= 0:
        return (compute_s, 0.0)
    return (compute_s * time.fwd_s / total, compute_s * time.bwd_s / total)


def _edges(graph: OpGraph, setup: CostSetup) -> list[tuple[int, int, float]]:
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    itemsize = setup.activation_itemsize
    found: dict[tuple[int, int], float] = {}
    for v, node in enumerate(graph.nodes):
        for name, meta in zip(node.inputs, node.input_metas, strict=True):
            if name not in position:
                continue
            size = meta.numel * itemsize if itemsize and meta.is_floating else meta.nbytes
            key = (position[name], v)
            found[key] = max(found.get(key, 0.0), float(size))
    return [(u, v, b) for (u, v), b in sorted(found.items())]


def total_time_s(problem: PlacementProblem) -> float:
    """Seconds of every op on one speed-1 device for all microbatches (the sequential bound)."""
    return math.fsum(problem.time_s(op) for op in range(problem.num_ops)) * problem.num_microbatches
