"""RL device placement (Mirhoseini et al. 2017, 2018): REINFORCE over group placements, judged by the simulator.

**Grouping** (:func:`group_ops`, co-location as in Mirhoseini et al. 2017). With ``N`` ops,
``D`` devices and ``t_i = fwd_s[i] + bwd_s[i]``, there are ``G = min(256, 20·D, N)``
(:func:`num_groups`) contiguous ranges of ops in topological order of roughly equal time: op
``i`` opens group ``g + 1`` when the time before its midpoint, ``Σ_{j<i} t_j + t_i / 2``, reaches
``(g + 1)·T / G`` (``T = Σ t_i``), and whenever the ops left are only just enough to give every
remaining group one. Every op of a group goes where its group goes. The search simulates the
grouped problem (:func:`group_problem`: each group one op, the sums of its ops' numbers, the
bytes between groups summed), which lowers to the same chunks and transfers as the per-op
assignment; the returned assignment is simulated once more on the original problem.

**Policy** (:class:`GroupPolicy`). Group ``g`` has features ``x_g`` (:func:`group_features`:
position, and ``log(1 + G·share)`` of time, memory, bytes sent and bytes received) and logits

    ℓ_g = W₃ tanh(W₂ tanh(W₁ x_g + c₁) + c₂) + c₃ + θ_g,     π(d | g) = softmax(ℓ_g)_d,

where the MLP shares what it learns across groups (e.g. position → device, a pipeline) and the
table ``θ`` lets the policy represent any placement. ``θ`` and the output layer ``W₃, c₃`` start
at zero, so the first placements are uniform; the table learns at rate 0.1 and the MLP at 0.002
(:data:`LEARNING_RATE`, :data:`MLP_LEARNING_RATE`): Adam moves each of the MLP's ~1,500 weights
by about its rate per step, all of which shift every group's logits at once, and a faster MLP
collapsed the policy onto one device within a few iterations. A placement ``a = (a_1 … a_G)``
takes a device per group independently: ``log π(a) = Σ_g log π(a_g | g)``.

**Reward** (:func:`reward`, :func:`penalized_runtime`, :func:`overflow_ratio`). With ``R(a)`` the
simulated step time (:func:`planner.baselines.placement.dataflow.simulate_assignment`) and ``T₁`` the time of the
whole step on one speed-1 device without transfers (:func:`sequential_time_s`), the reward is
``r(a) = −√(R'(a) / T₁)``: dividing by ``T₁`` makes it O(1) (about −1/√D for a good placement on
``D`` devices) whatever the model, so one learning rate serves every problem. A placement that
does not fit gets a large runtime instead:

    R'(a) = R(a)                                   if peak_d ≤ M_d for every device d,
    R'(a) = R(a) · 10 · (1 + max_d (peak_d − M_d) / M_d)   otherwise,

``peak_d`` the simulated peak memory and ``M_d`` the capacity (``device_memory_bytes``): at least
ten times slower than it would be, and worse the further it overflows, so the gradient also
points from a badly overfull placement towards a less full one.

**REINFORCE** (:func:`_train_step`, Williams 1992). Each iteration samples ``S`` placements
``a_s ~ π`` and minimises

    L = −(1/S) Σ_s (r(a_s) − b) log π(a_s) − β · (1/G) Σ_g H(π(· | g)),

whose gradient estimates ``−∇ E_π[r]`` (plus a small entropy bonus ``β``) with Adam. The
baseline ``b`` is a moving average of the rewards with decay 0.9 (Mirhoseini et al. 2017):
``b ← mean r`` after the first iteration, then ``b ← 0.9·b + 0.1·mean r`` after each, the
advantage of an iteration using ``b`` before its update (zero-mean on the first).

**Search** (:func:`rl_placement`). After its update each iteration also simulates the policy's
mode (the argmax device per group; not part of the gradient, and judged after the update so that
the arbitrary all-on-device-0 argmax of the uniform start is not), so the best seen tracks the
mode. Simulated times are cached per group placement (:class:`_Judge`). The search stops after
``max_iterations``, once ``budget_s`` of wall time is spent (checked after each iteration) or
once every placement has been simulated (one device, a tiny graph), and returns the fastest
placement that fits; when none was seen it raises :class:`planner.errors.AutoplanError`. The
policy and the samples use a local ``torch.Generator`` seeded with ``seed``, so results are
reproducible and the global RNG is untouched.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from cost_models.units import GIB
from planner.baselines.placement.dataflow import simulate_assignment
from planner.baselines.placement.problem import PlacementProblem, total_time_s
from planner.errors import AutoplanError

ALGORITHM = "rl placement"
MAX_GROUPS = 256
GROUPS_PER_DEVICE = 20
HIDDEN = 32
LEARNING_RATE = 0.1  # Adam, per-group table
MLP_LEARNING_RATE = 0.002  # Adam, MLP: its weights move every group's logits at once
ENTROPY_WEIGHT = 0.01
BASELINE_DECAY = 0.9
PENALTY_FACTOR = 10.0

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class RLResult:
    assignment: tuple[int, ...]  # device per op
    step_time_s: float  # simulated, of ``assignment``
    iterations: int
    num_simulations: int  # simulator runs (cache hits excluded, the final check included)
    mean_reward: tuple[float, ...]  # per iteration: mean reward of its sampled placements
    time_s: float


def rl_placement(
    problem: PlacementProblem,
    *,
    budget_s: float = 30.0,
    seed: int = 0,
    max_iterations: int | None = None,
    samples_per_iteration: int = 8,
    progress: Progress | None = None,
) -> RLResult:
    """Device per op: REINFORCE over group placements (Mirhoseini et al. 2017, 2018), best that fits."""
    assert problem.num_ops > 0 and samples_per_iteration >= 1 and (max_iterations is None or max_iterations >= 1)
    if not budget_s > 0:
        raise AutoplanError(f"{ALGORITHM}: the time budget must be positive, got {budget_s} s")
    start = time.perf_counter()
    count = num_groups(problem)
    groups = group_ops(problem, count)
    grouped = group_problem(problem, groups)
    judge = _Judge(problem=grouped, reference_s=sequential_time_s(problem))
    generator = torch.Generator().manual_seed(seed)
    policy = GroupPolicy(group_features(grouped), problem.num_devices, generator=generator)
    optimizer = torch.optim.Adam([{"params": [policy.table], "lr": LEARNING_RATE},
                                  {"params": [*policy.weights, *policy.biases], "lr": MLP_LEARNING_RATE}])  # fmt: skip
    curve: list[float] = []
    baseline: float | None = None
    while True:
        baseline = _train_step(policy, optimizer, judge, generator, samples=samples_per_iteration, baseline=baseline,
                               curve=curve)  # fmt: skip
        if progress is not None:
            progress("rl", len(curve), 0)
        exhausted = len(judge.cache) == problem.num_devices**count  # every placement simulated
        if exhausted or len(curve) == max_iterations or time.perf_counter() - start >= budget_s:
            break
    if judge.best is None:
        raise _nothing_fits(problem, judge.num_simulations, time.perf_counter() - start)
    assignment = tuple(judge.best[g] for g in groups)
    step_time_s = simulate_assignment(problem, assignment).step_time_s
    return RLResult(assignment=assignment, step_time_s=step_time_s, iterations=len(curve),
                    num_simulations=judge.num_simulations + 1, mean_reward=tuple(curve),
                    time_s=time.perf_counter() - start)  # fmt: skip


def num_groups(problem: PlacementProblem) -> int:
    return min(MAX_GROUPS, GROUPS_PER_DEVICE * problem.num_devices, problem.num_ops)


def group_ops(problem: PlacementProblem, count: int) -> tuple[int, ...]:
    """Group per op: ``count`` contiguous ranges in topological order of roughly equal time, none empty."""
    n = problem.num_ops
    assert 1 <= count <= n
    weights = [problem.time_s(op) for op in range(n)]
    total = math.fsum(weights)
    if total <= 0:
        weights, total = [1.0] * n, float(n)
    groups: list[int] = []
    group, before = 0, 0.0
    for op, weight in enumerate(weights):
        due = before + weight / 2 >= (group + 1) * total / count
        forced = n - op == count - 1 - group  # one op left for each group still to open
        if op > 0 and group < count - 1 and (due or forced):
            group += 1
        groups.append(group)
        before += weight
    return tuple(groups)


def group_problem(problem: PlacementProblem, groups: Sequence[int]) -> PlacementProblem:
    """The problem with each group one op: its ops' numbers summed, the bytes between groups summed."""
    count = max(groups) + 1
    members: list[list[int]] = [[] for _ in range(count)]
    for op, group in enumerate(groups):
        members[group].append(op)

    def summed(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(math.fsum(values[op] for op in ops) for ops in members)

    between: dict[tuple[int, int], float] = {}
    for u, v, num_bytes in problem.edges:
        key = (groups[u], groups[v])
        if key[0] != key[1]:
            between[key] = between.get(key, 0.0) + num_bytes
    return PlacementProblem(
        names=tuple(f"group {g}" for g in range(count)),
        fwd_s=summed(problem.fwd_s),
        bwd_s=summed(problem.bwd_s),
        step_s=summed(problem.step_s),
        state_bytes=summed(problem.state_bytes),
        activation_bytes=summed(problem.activation_bytes),
        edges=tuple((u, v, b) for (u, v), b in sorted(between.items())),
        device_speed=problem.device_speed,
        device_memory_bytes=problem.device_memory_bytes,
        num_microbatches=problem.num_microbatches,
        transfer_s=problem.transfer_s,
    )


def group_features(grouped: PlacementProblem) -> torch.Tensor:
    """``(G, 5)``: position in [0, 1], then ``log(1 + G·share)`` of time, memory, bytes out and bytes in."""
    count = grouped.num_ops
    sent, received = [0.0] * count, [0.0] * count
    for u, v, num_bytes in grouped.edges:
        sent[u] += num_bytes
        received[v] += num_bytes
    columns = [
        [(g + 0.5) / count for g in range(count)],
        *(_shares([measure(g) for g in range(count)]) for measure in (grouped.time_s, grouped.memory_bytes)),
        _shares(sent),
        _shares(received),
    ]
    return torch.tensor(columns, dtype=torch.float32).T.contiguous()


def _shares(values: list[float]) -> list[float]:
    total = math.fsum(values)
    return [math.log1p(len(values) * v / total) if total > 0 else 0.0 for v in values]


def sequential_time_s(problem: PlacementProblem) -> float:
    """``T₁``: the whole step on one speed-1 device, no transfers (the reward's scale; 1 if that is 0)."""
    seconds = total_time_s(problem) + math.fsum(problem.step_s)
    return seconds if seconds > 0 else 1.0


def overflow_ratio(peak_bytes: Sequence[float], capacity_bytes: Sequence[float]) -> float:
    """``max_d (peak_d − M_d) / M_d``: positive when some device's simulated peak exceeds its capacity."""
    return max((peak - cap) / max(cap, 1.0) for peak, cap in zip(peak_bytes, capacity_bytes, strict=True))


def penalized_runtime(step_time_s: float, overflow: float) -> float:
    """``R'``: the step time, or ``step · 10 · (1 + overflow)`` for a placement that does not fit."""
    return step_time_s if overflow <= 0 else step_time_s * PENALTY_FACTOR * (1.0 + overflow)


def reward(runtime_s: float, reference_s: float) -> float:
    """``r = −√(R' / T₁)``."""
    return -math.sqrt(runtime_s / reference_s)


class GroupPolicy(nn.Module):
    """Logits ``(G, D)``: a tanh MLP over the group features plus a per-group table (zero at start)."""

    def __init__(self, features: torch.Tensor, num_devices: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.register_buffer("features", features)
        sizes = [features.shape[1], HIDDEN, HIDDEN, num_devices]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
            # nn.Linear's default, drawn from the local generator; the output layer starts at 0 (π uniform)
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
        return hidden + self.table


def _uniform(shape: tuple[int, ...], bound: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


@dataclass(kw_only=True)
class _Judge:
    """Rewards of group placements by simulation, cached; keeps the fastest placement that fits."""

    problem: PlacementProblem  # the grouped problem
    reference_s: float
    cache: dict[tuple[int, ...], float] = field(default_factory=dict)  # placement -> R'
    num_simulations: int = 0
    best: tuple[int, ...] | None = None
    best_s: float = math.inf

    def reward(self, placement: tuple[int, ...]) -> float:
        if placement not in self.cache:
            sim = simulate_assignment(self.problem, placement)
            self.num_simulations += 1
            overflow = overflow_ratio(sim.peak_memory_bytes, self.problem.device_memory_bytes)
            runtime = penalized_runtime(sim.step_time_s, overflow)
            self.cache[placement] = runtime
            if overflow <= 0 and runtime < self.best_s:
                self.best, self.best_s = placement, runtime
        return reward(self.cache[placement], self.reference_s)


def _train_step(policy: GroupPolicy, optimizer: torch.optim.Optimizer, judge: _Judge, generator: torch.Generator, *,
                samples: int, baseline: float | None, curve: list[float]) -> float:  # fmt: skip
    """One REINFORCE iteration: sample, judge, step Adam, judge the new mode; the updated baseline."""
    log_probs = torch.log_softmax(policy(), dim=-1)  # (G, D)
    probs = log_probs.exp()
    placements = torch.multinomial(probs.detach(), samples, replacement=True, generator=generator).T  # (S, G)
    rewards = torch.tensor([judge.reward(tuple(p)) for p in placements.tolist()], dtype=torch.float64)
    mean = float(rewards.mean())
    curve.append(mean)
    if baseline is None:
        baseline = mean
    advantage = (rewards - baseline).to(log_probs.dtype)
    chosen = log_probs.gather(1, placements.T).sum(dim=0)  # log π(a_s), (S,)
    entropy = -(probs * log_probs).sum(dim=-1).mean()
    loss = -(advantage * chosen).mean() - ENTROPY_WEIGHT * entropy
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        judge.reward(tuple(policy().argmax(dim=-1).tolist()))  # the updated policy's mode
    return BASELINE_DECAY * baseline + (1 - BASELINE_DECAY) * mean


def _nothing_fits(problem: PlacementProblem, simulations: int, seconds: float) -> AutoplanError:
    low, high = min(problem.device_memory_bytes) / GIB, max(problem.device_memory_bytes) / GIB
    capacity = f"{low:.2f} GiB" if low == high else f"{low:.2f} to {high:.2f} GiB"
    return AutoplanError(
        f"{ALGORITHM}: no placement that fits in {capacity} per device found in {simulations} simulations "
        f"({seconds:.1f} s): raise --rl-budget-s, add devices or lower the batch"
    )
