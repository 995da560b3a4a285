"""The RL placer's policy: each group's device as a shift from the device of the group before it.

Groups ``g = 0 … G−1`` are ranges of ops in topological order (:func:`planner.baselines.placement.rl.group_ops`).
The policy does not pick group ``g``'s device ``d_g`` directly but its *shift* ``s_g ∈ {0 … D−1}`` from
the device before it, ``d_g = (d_{g−1} + s_g) mod D`` (``d_{−1} = 0``), the way the hierarchical
planner's placer conditions each group's device on the previous group's (Mirhoseini et al. 2018).
Shifts and devices are in one-to-one correspondence, so every placement can be drawn; but "stay"
(``s = 0``) and "next device" (``s = 1``) mean the same thing for every group, so what the policy
learns at one group (keep this range with the one before; cut here) carries to the others, and
the placements it draws are contiguous runs whatever their devices.

**Logits** (:class:`ShiftPolicy`), per group ``g`` and shift ``s``:

    ℓ_g(s) = p(s) + θ_g[s] + W₃ tanh(W₂ tanh(W₁ x_g + c₁) + c₂)[s] + c₃[s],      π(s | g) = softmax(ℓ_g)_s,

* ``x_g`` the group's features (:func:`group_features`): position in ``[0, 1]``; ``log(1 + G·share)`` of
  its time, memory, bytes received and bytes sent; the bytes a cut just before it would send
  (every edge from a group before ``g`` to ``g`` or after); and the mean time share of its graph
  neighbours (the groups it exchanges edges with);
* ``p`` a fixed prior (:func:`shift_prior`): ``p(0) = log((1 − q)/q)`` with ``q = min(½, R·D/G)`` and
  ``R = 2`` (:data:`PRIOR_ROUNDS`), ``p(1) = 0``, ``p(s) = −2`` otherwise: at the start the policy
  draws about ``R·D`` cuts, mostly to the next device, so its first samples are pipelines of
  about ``R`` rounds over the devices with random cut points — not random scatters, which on a
  real model are 5–20× slower than a pipeline and teach little;
* ``θ`` a per-group table (any placement can become the mode), and an MLP shared by all groups
  (what it learns from one group's features carries to the others); ``θ`` and the output layer
  ``W₃, c₃`` start at zero.

A placement is the shifts drawn independently: ``log π(a) = Σ_g log π(s_g | g)``
(:func:`log_prob`), so a batch of ``S`` placements is sampled at once (:func:`sample`), devices by a
cumulative sum of shifts mod ``D``.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from planner.baselines.placement.problem import PlacementProblem

HIDDEN = 32
PRIOR_ROUNDS = 2  # cuts at the start ≈ PRIOR_ROUNDS × devices
OTHER_SHIFT_PRIOR = -2.0  # logit of a shift other than 0 and 1, against 1's 0


def shift_prior(num_groups: int, num_devices: int) -> torch.Tensor:
    """``p``: the prior logits of the shifts (``(D,)``)."""
    prior = torch.full((num_devices,), OTHER_SHIFT_PRIOR)
    if num_devices == 1:
        return torch.zeros(1)
    cut = min(0.5, PRIOR_ROUNDS * num_devices / num_groups)
    prior[0] = math.log((1 - cut) / cut)
    prior[1] = 0.0
    return prior


def group_features(grouped: PlacementProblem) -> torch.Tensor:
    """``(G, 7)``: position, then log-shares of time, memory, bytes in, bytes out, cut bytes, neighbours' time."""
    count = grouped.num_ops
    sent, received, cut = [0.0] * count, [0.0] * count, [0.0] * (count + 1)
    neighbours: list[set[int]] = [set() for _ in range(count)]
    for u, v, num_bytes in grouped.edges:
        sent[u] += num_bytes
        received[v] += num_bytes
        cut[u + 1] += num_bytes  # crossing every boundary from u + 1 to v
        cut[v + 1] -= num_bytes
        neighbours[u].add(v)
        neighbours[v].add(u)
    crossing = list(itertools.accumulate(cut[:count]))
    time_share = _shares([grouped.time_s(g) for g in range(count)])
    columns = [
        [(g + 0.5) / count for g in range(count)],
        time_share,
        _shares([grouped.memory_bytes(g) for g in range(count)]),
        _shares(received),
        _shares(sent),
        _shares([max(0.0, c) for c in crossing]),
        [sum(time_share[n] for n in near) / len(near) if near else 0.0 for near in neighbours],
    ]
    return torch.tensor(columns, dtype=torch.float32).T.contiguous()


def _shares(values: list[float]) -> list[float]:
    total = math.fsum(values)
    return [math.log1p(len(values) * v / total) if total > 0 else 0.0 for v in values]


class ShiftPolicy(nn.Module):
    """Logits ``(G, D)`` over each group's shift: prior + per-group table + a tanh MLP over the features."""

    def __init__(self, features: torch.Tensor, num_devices: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.register_buffer("features", features)
        self.register_buffer("prior", shift_prior(features.shape[0], num_devices))
        sizes = [features.shape[1], HIDDEN, HIDDEN, num_devices]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            # nn.Linear's default, drawn from the local generator; the output layer starts at 0
            bound = 1.0 / math.sqrt(fan_in) if layer < len(sizes) - 2 else 0.0
            self.weights.append(nn.Parameter(_uniform((fan_in, fan_out), bound, generator)))
            self.biases.append(nn.Parameter(_uniform((fan_out,), bound, generator)))
        self.table = nn.Parameter(torch.zeros(features.shape[0], num_devices))

    def forward(self) -> torch.Tensor:
        hidden = self.features
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            hidden = hidden @ weight + bias
            if layer < len(self.weights) - 1:
                hidden = torch.tanh(hidden)
        return self.prior + self.table + hidden


def _uniform(shape: tuple[int, ...], bound: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def sample(log_probs: torch.Tensor, count: int, *, generator: torch.Generator) -> torch.Tensor:
    """``(count, G)`` shifts drawn from ``softmax`` of ``log_probs`` (``(G, D)``)."""
    return torch.multinomial(log_probs.detach().exp(), count, replacement=True, generator=generator).T


def devices_of(shifts: torch.Tensor, num_devices: int) -> torch.Tensor:
    """Devices ``d_g = (Σ_{k ≤ g} s_k) mod D`` of shifts ``(S, G)``."""
    return torch.cumsum(shifts, dim=-1) % num_devices


def shifts_of(devices: torch.Tensor, num_devices: int) -> torch.Tensor:
    """The inverse of :func:`devices_of`."""
    before = torch.nn.functional.pad(devices[..., :-1], (1, 0))
    return (devices - before) % num_devices


def log_prob(log_probs: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """``log π(a_s) = Σ_g log π(s_g | g)`` for shifts ``(S, G)``: ``(S,)``."""
    return log_probs.gather(1, shifts.T).sum(dim=0)
