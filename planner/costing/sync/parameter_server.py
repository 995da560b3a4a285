"""What a parameter server (``GradSync`` ``ps`` ``S`` [``K``]; :mod:`executors.parameter_server`) costs a DDP stage.

Layout, shared with the executor: the ``S`` servers are the ranks :func:`server_ranks` picks among the stage's ``d``
replicas, spread evenly (``devices[k·d // S]``: across nodes before within one); each gradient (whole tensors, as
ps-lite shards keys) goes to the shard :func:`server_shards` assigns, the largest first to the least-loaded shard.
Shard ``k`` holds ``N_k`` elements; ``N = Σ N_k``.

A step, after the last backward (nothing overlaps the backward: the push starts when every gradient is ready):

* push (:func:`exchange_s`): every replica sends shard ``k``'s gradient (``N_k·b`` bytes, ``b`` the gradient
  itemsize) to server ``k`` (a server's own replica copies it locally). The transfers run at once; the phase lasts
  as long as its busiest endpoint. On the inter-node link a node's NICs carry what its replicas send to other
  nodes' servers and, apart (full duplex), what its servers receive from other nodes: ``nics × β_inter`` for the
  node, one NIC's ``β_inter`` for any one device, each direction. On the intra-node link each server receives from
  its own node's replicas. So ``max(α_inter + max(node bytes / (nics·β_inter), device bytes / β_inter),
  α_intra + server bytes / β_intra)``, each term only where such traffic exists;
* the servers average the ``d`` gradients of their shard and run the optimizer on it: the optimizer step of the
  plan (:func:`planner.costing.offload.optimizer_step_s`) scaled by the largest shard's share ``max_k N_k / N``
  (:attr:`PsSync.optimizer_share`; the other replicas wait for it);
* pull (:func:`exchange_s` again): server ``k`` sends its shard's parameters (``N_k`` fp32 master weights,
  :data:`MASTER_WEIGHT_BYTES`) to every other replica.

With staleness ``K > 0`` the push of step ``t`` is waited for at step ``t + K``: ``K`` backwards hide it, and
the step waits for ``max(0, push − K·backward)`` (the window conservative as for DGA, :mod:`.delayed`); the
server's update and the pull stay on the critical path (:func:`ps_sync`).

Compute on the device (:func:`ps_copy_s`, at the streaming bandwidth): flattening every gradient into the shards'
send buffers (read and write ``N·b``), the busiest server's average (read ``d`` buffers of ``N_k·b``, write one)
and copying the pulled parameters back (read and write ``4·N``), :data:`PS_KERNELS` kernels a shard.

Memory per device (:attr:`PsSync.state_bytes`, the busiest server's): ``K + 1`` steps of send buffers
(``(K + 1)·N·b``) and of receive buffers (``(K + 1)·(d − 1)·N_k·b``), the pulled parameters' buffer (``4·N``),
less the optimizer state of the shards it does not serve (``(1 − N_k / N)·s·N``, ``s`` the optimizer's state
bytes a parameter): the optimizer state lives on the servers only. The sum is negative when that saving is larger.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.cluster import Cluster
from cost_models.memory import optimizer_bytes
from planner.costing.setup import CostSetup

MASTER_WEIGHT_BYTES = 4  # the servers send the fp32 parameters the optimizer updates
PS_KERNELS = 3  # flatten, average, copy back, per shard


def server_ranks(devices: Sequence[int], servers: int) -> tuple[int, ...]:
    """The ranks that serve the ``servers`` shards: ``devices[k·d // S]``, spread over the replicas."""
    assert 0 < servers <= len(devices), f"{servers} servers for {len(devices)} replicas"
    return tuple(devices[k * len(devices) // servers] for k in range(servers))


def server_shards(sizes: Sequence[int], servers: int) -> tuple[int, ...]:
    """The shard of each tensor of ``sizes`` elements: the largest first, each to the least-loaded shard (the
    lowest-numbered on a tie), so the shards' sizes differ by at most the largest tensor."""
    loads = [0] * servers
    shard = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(servers), key=lambda k: (loads[k], k))
        shard[index] = target
        loads[target] += sizes[index]
    return tuple(shard)


def exchange_s(
    shard_bytes: Sequence[float], *, servers: Sequence[int], devices: Sequence[int], cluster: Cluster
) -> float:
    """One phase of transfers between every replica of ``devices`` and every server (shard ``k`` of
    ``shard_bytes[k]`` bytes, held by ``servers[k]``), all at once, as long as its busiest endpoint (module
    docstring). Symmetric: a push and a pull of the same bytes take as long."""
    replicas = Counter(cluster.node_of(rank) for rank in devices)  # replicas per node
    served = Counter()  # per node, the bytes of the shards its servers hold
    node_in, node_out = Counter(), Counter()  # the NICs are full duplex: each direction apart
    device_in, intra_bytes = 0.0, 0.0  # the busiest server's receipts from other nodes, and from its own
    for server, size in zip(servers, shard_bytes, strict=True):
        home = cluster.node_of(server)
        served[home] += size
        remote = len(devices) - replicas[home]  # replicas on other nodes send it one shard each
        node_in[home] += remote * size
        device_in = max(device_in, remote * size)
        intra_bytes = max(intra_bytes, (replicas[home] - 1) * size)
        for node, count in replicas.items():
            if node != home:
                node_out[node] += count * size
    total = sum(shard_bytes)
    device_out = max(total - served[node] for node in replicas)  # a replica sends every shard held elsewhere
    node_bytes = max([*node_in.values(), *node_out.values(), 0.0])
    times = [0.0]
    if node_bytes > 0:
        link = cluster.inter_node
        nics = cluster.devices_per_node if cluster.nics_per_node is None else cluster.nics_per_node
        busiest = max(node_bytes / nics, device_in, device_out)
        times.append(link.latency_s + busiest / link.bandwidth)
    if intra_bytes > 0:
        times.append(cluster.intra_node.latency_s + intra_bytes / cluster.intra_node.bandwidth)
    return max(times)


@dataclass(frozen=True, kw_only=True)
class PsSync:
    """A stage's parameter-server step: what the step waits for after its last backward (``exposed_s``, the push
    beyond what staleness hides, plus the pull), the push ``K`` backwards hide (``hidden_s``), the device copies
    (``copy_s``), the share of the optimizer step the busiest server runs and the memory it adds."""

    exposed_s: float
    hidden_s: float
    copy_s: float
    optimizer_share: float
    state_bytes: float


def ps_sync(
    sizes: Sequence[int], *, devices: Sequence[int], servers: int, staleness: int, backward_s: float, setup: CostSetup
) -> PsSync:
    """The parameter server over ``devices`` for gradients of ``sizes`` elements (module docstring)."""
    per_param = optimizer_bytes(setup.optimizer)
    shard_of = server_shards(sizes, servers)
    shard_numel = [0] * servers
    for size, shard in zip(sizes, shard_of, strict=True):
        shard_numel[shard] += size
    ranks, cluster = server_ranks(devices, servers), setup.cluster
    push = exchange_s([n * per_param.grads for n in shard_numel], servers=ranks, devices=devices, cluster=cluster)
    pull = exchange_s([n * MASTER_WEIGHT_BYTES for n in shard_numel], servers=ranks, devices=devices, cluster=cluster)
    exposed_push = max(0.0, push - staleness * backward_s)
    total, largest = sum(shard_numel), max(shard_numel)
    share = largest / total if total else 1.0
    buffers = (staleness + 1) * (total + (len(devices) - 1) * largest) * per_param.grads
    state = buffers + MASTER_WEIGHT_BYTES * total - (1.0 - share) * per_param.state * total
    return PsSync(
        exposed_s=exposed_push + pull,
        hidden_s=push - exposed_push,
        copy_s=ps_copy_s(total, largest, replicas=len(devices), servers=servers, setup=setup),
        optimizer_share=share,
        state_bytes=state,
    )


def ps_copy_s(total: int, largest: int, *, replicas: int, servers: int, setup: CostSetup) -> float:
    """Flatten the gradients, average the busiest shard, copy the pulled parameters back (module docstring)."""
    device = setup.cluster.device
    itemsize = optimizer_bytes(setup.optimizer).grads
    moved = 2 * total * itemsize + (replicas + 1) * largest * itemsize + 2 * MASTER_WEIGHT_BYTES * total
    return (
        moved / (device.memory_bandwidth * device.memory_efficiency) + PS_KERNELS * servers * device.kernel_overhead_s
    )
