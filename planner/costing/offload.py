"""CPU offload under FSDP2 (``Stage.offload``): what ``CPUOffloadPolicy`` moves to the host, and what it costs.

torch's ``CPUOffloadPolicy`` (``torch.distributed.fsdp``) keeps each device's shards of the parameters, the
gradients and the optimizer state in host memory. Before every all-gather the group's parameter shard is copied
host-to-device; after every reduce-scatter the gradient shard is copied device-to-host (and accumulated there);
the optimizer steps on the CPU, on host tensors. The unsharded parameters FSDP all-gathers stay in device memory
(the layer being computed, the one prefetched; levels 1 and 2 keep every parameter gathered for the step), and so
do the gradients before their reduce-scatter. Per device, with ``d`` replicas, ``N`` parameters, ``w``, ``g``,
``s`` bytes per parameter of weights, gradients and optimizer state (:func:`cost_models.memory.optimizer_bytes`),
``H`` the host link (:mod:`cost_models.device`):

* memory (:func:`offloaded_shards`): the shards leave the device, ``N·(w/d + s/d)`` and, at levels 2 and 3, the
  gradient shards ``N·g/d``; level 1 still accumulates whole gradients on the device (it reduce-scatters them in
  the step's last backward only), so only their shard after the reduce-scatter moves. Every other charge of
  :func:`planner.costing.zero.fsdp_memory` stays: the gathered groups, the unsharded gradients, the activations.
  The host-to-device copy of the shard being gathered (``1/d`` of a group, FSDP2's all-gather input) is not
  charged. On CPU ranks the host is the rank's own memory: nothing leaves it (:func:`offloads_memory`). The host
  holds every device's shards, ``N·(w + g + s)/d`` each (:func:`host_bytes`), against the node's DRAM
  (:attr:`cost_models.device.HostLink.host_memory_bytes`).
* copies (:func:`host_copy_s`): each group's all-gather waits for its shard's copy in, ``bytes_w/d / H.bandwidth``,
  and each reduce-scatter is followed by its shard's copy out, ``bytes_g/d / H.bandwidth``; they run on FSDP's
  communication streams before and after the collective, so :func:`planner.costing.zero.fsdp_groups` adds them to
  the group's gather and scatter seconds and :func:`planner.costing.zero.fsdp_timeline` overlaps them with the
  compute exactly as it overlaps the collectives (prefetched a group ahead).
* the optimizer step (:func:`host_optimizer_s`): Adam on the CPU streams its state: it reads the weights, the
  gradients and the state and writes the weights and the state, ``N/d·(2·(w + s) + g)`` bytes at the host memory
  bandwidth one device's share gets (:attr:`cost_models.device.HostLink.per_device_memory_bandwidth`). It runs
  after the last backward, overlapped with nothing; it replaces the device's optimizer step
  (:func:`optimizer_step_s`).

Offload never saves time: it is a memory choice the planner makes only when nothing fits without it
(:mod:`planner.baselines.offloaded`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cost_models.memory import optimizer_bytes, zero_shards
from planner.costing.runtime_profiles import autocast_cast_seconds, casts_parameters
from planner.costing.setup import CostSetup
from planner.ir.graph import OpGraph
from planner.plan import Stage

ON_HOST = math.inf  # a shard count: every shard in host memory, none on the device


def offloaded_shards(level: int, num_devices: int, *, offload: bool) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) shard counts on the device at ZeRO ``level``
    (:func:`cost_models.memory.zero_shards`), :data:`ON_HOST` for what offload keeps on the host."""
    weights, grads, state = zero_shards(level, num_devices)
    if not offload:
        return weights, grads, state
    return ON_HOST, ON_HOST if level >= 2 else grads, ON_HOST


def offloads_memory(stage: Stage, setup: CostSetup) -> bool:
    """Whether the stage's offload moves memory off its devices: not on CPU ranks, whose host is their own memory
    (the policy runs there, its copies no-ops, and nothing is saved)."""
    return stage.offload and not setup.cluster.device.is_cpu()


def host_bytes(stage: Stage, graph: OpGraph, setup: CostSetup) -> float:
    """What the offloaded shards of every device of a node take in its host memory: each device's shards of the
    weights, gradients and optimizer state, ``N·(w + g + s)/d``, times the node's devices on the stage."""
    per, n = optimizer_bytes(setup.optimizer), len(stage.devices)
    on_node = min(n, setup.cluster.devices_per_node)
    return on_node * graph.num_params * (per.weights + per.grads + per.state) / n


def host_copy_s(num_bytes: float, setup: CostSetup) -> float:
    """Seconds to copy ``num_bytes`` between a device and its host, one direction
    (:func:`cost_models.device.host_link`)."""
    return setup.cluster.host().copy_s(num_bytes)


def host_optimizer_s(stage: Stage, graph: OpGraph, setup: CostSetup) -> float:
    """The optimizer step on the CPU over this device's ``1/d`` of the parameters (module docstring)."""
    per = optimizer_bytes(setup.optimizer)
    chosen = set(stage.nodes)
    read = {value for node in graph.nodes if node.name in chosen for value in node.inputs}
    numel = math.fsum(param.meta.numel for param in graph.params if param.name in read) / len(stage.devices)
    streamed = numel * (2 * (per.weights + per.state) + per.grads)
    return streamed / setup.cluster.host().per_device_memory_bandwidth


def optimizer_step_s(stage: Stage, graph: OpGraph, setup: CostSetup, *, work: Mapping[str, object]) -> float:
    """The step's optimizer update under FSDP: on the device, each node's step without its ZeRO share (``NodeWork``:
    ``step_s`` − ``zero_step_s``), or on the host when the stage offloads (:func:`host_optimizer_s`)."""
    if stage.offload:
        return host_optimizer_s(stage, graph, setup)
    return math.fsum(w.step_s - w.zero_step_s for w in work.values())  # type: ignore[attr-defined]


def offloaded_casts_s(stage: Stage, graph: OpGraph, setup: CostSetup) -> float:
    """Under offload, autocast's casts of the stage's gathered weights on the device, once per step
    (:mod:`planner.costing.runtime_profiles`; without offload they are in each node's ``step_s``); 0 otherwise."""
    if not stage.offload:
        return 0.0
    device, params = setup.cluster.device, set(graph.param_names)
    total = 0.0
    for name in stage.nodes:
        node = graph.node(name)
        if casts_parameters(node.kind, runtime=setup.runtime, optimizer=setup.optimizer, device=device):
            metas = [meta for value, meta in zip(node.inputs, node.input_metas, strict=True) if value in params]
            numel = math.fsum(meta.numel for meta in metas)
            total += autocast_cast_seconds(numel=numel, num_params=len(metas), device=device) if metas else 0.0
    return total
