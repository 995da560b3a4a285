"""RL device placement (Mirhoseini et al. 2017, 2018): REINFORCE over group placements, judged by the simulator.

**Grouping** (:func:`group_ops`, co-location as in Mirhoseini et al. 2017). With ``N`` ops,
``D`` devices and ``t_i = fwd_s[i] + bwd_s[i]``, there are ``G = min(256, 32·D, N)``
(:func:`num_groups`) contiguous ranges of ops in topological order of roughly equal time: op
``i`` opens group ``g + 1`` when the time before its midpoint, ``Σ_{j<i} t_j + t_i / 2``, reaches
``(g + 1)·T / G`` (``T = Σ t_i``), and whenever the ops left are only just enough to give every
remaining group one. Every op of a group goes where its group goes. The grouping is fixed, not
learned as the 2018 planner's grouper is. The search simulates the grouped problem
(:func:`group_problem`: each group one op, the sums of its ops' numbers, the bytes between groups
summed), which lowers to the same chunks and transfers as the per-op assignment; the returned
assignment is simulated once more on the original problem.

**Policy** (:mod:`planner.baselines.placement.rl_policy`): each group's device as a shift from the
device of the group before it, logits = a fixed prior (start with pipelines of about two rounds
over the devices) + a per-group table + an MLP over graph features of the group (cost, memory,
bytes in and out, the bytes a cut before it sends, its neighbours' cost, position).

**Reward** (:func:`reward`, :func:`penalized_runtime`, :func:`overflow_ratio`). With ``R(a)`` the
simulated step time (:func:`planner.baselines.placement.batched_simulator.simulate_placements`, the
simulator's step for a whole batch of placements, bit for bit) and ``T₁`` the time of the whole step
on one speed-1 device without transfers (:func:`sequential_time_s`), the reward is
``r(a) = −√(R'(a) / T₁)``: dividing by ``T₁`` makes it O(1) whatever the model. A placement that
does not fit gets a large runtime instead:

    R'(a) = R(a)                                   if peak_d ≤ M_d for every device d,
    R'(a) = R(a) · 10 · (1 + max_d (peak_d − M_d) / M_d)   otherwise,

``peak_d`` the simulated peak memory and ``M_d`` the capacity (``device_memory_bytes``), so the
problem's memory limits steer the policy and the search returns only a placement that fits.

**REINFORCE with a baseline** (:func:`_train_step`, Williams 1992). Each iteration samples ``S``
placements ``a_s ~ π`` (:data:`SAMPLES`, all simulated in one batch) and minimises

    L = −(1/S) Σ_s A_s log π(a_s) − β · (1/G) Σ_g H(π(· | g)),     A_s = (r_s − r̄) / (σ_r + ε),

``r̄`` and ``σ_r`` the mean and deviation of the iteration's rewards (the baseline, and a scale that
keeps Adam's steps alike from the first iterations to the last, when the samples differ little),
``β`` a small entropy bonus (:data:`ENTROPY_WEIGHT`). Adam: the table at :data:`LEARNING_RATE`,
the MLP at :data:`MLP_LEARNING_RATE` (its weights move every group's logits at once).

**Search** (:func:`rl_placement`). After its update each iteration also simulates the policy's mode
(the most likely shift per group; not part of the gradient). Simulated times are cached per group
placement (:class:`_Judge`). A policy has *converged* when an iteration brings at most
:data:`CONVERGED_FRESH` × ``S`` placements not simulated before; after :data:`PATIENCE` converged
iterations in a row without a faster placement, the search restarts with a fresh policy
(:func:`_fresh_policy`) whose mode is the fastest placement found so far: table
``θ_g = −p + μ·onehot(s*_g)``, ``s*`` that placement's shifts, ``μ = log(G(D−1)/k − (D−1))`` so that a
sample differs from it in about ``k`` groups (:data:`WARM_DEVIATIONS`), and REINFORCE goes on from there
(iterative improvement around the search's own best, as Placeto improves a placement; no heuristic's
placement is used). The search stops after ``max_iterations`` (deterministic: the same seed gives the
same placement), once ``budget_s`` of wall time is spent (checked after each iteration; the first call
in a process includes compiling the batched simulator, or loading it from numba's disk cache), or once
every placement has been simulated (a tiny graph), and returns the fastest placement that fits; when
none was seen it raises :class:`planner.errors.AutoplanError`. The policy and the samples use a local
``torch.Generator`` seeded with ``seed``, so results are reproducible and the global RNG is untouched.

The constants were chosen on a tuning set disjoint from the ``plan compare`` cases (GPT-760M on 8
A100s, GPT-125M on 8 H100s, ResNet on 8 H100s, MoE on 16 A100s, MLP on 16 V100s, GPT-350M on 16
A100s): the learning rates 0.05/0.002, 0.02/0.001 and 0.01/0.0005, restarts or none, ``k`` = 1, 2, 4,
keeping the lowest mean of the 30-second result over the best heuristic's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cost_models.units import GIB
from planner.baselines.placement.batched_simulator import simulate_placements
from planner.baselines.placement.dataflow import simulate_assignment
from planner.baselines.placement.problem import PlacementProblem, total_time_s
from planner.baselines.placement.rl_policy import ShiftPolicy, devices_of, group_features, log_prob, sample, shifts_of
from planner.errors import AutoplanError

ALGORITHM = "rl placement"
MAX_GROUPS = 256
GROUPS_PER_DEVICE = 32
SAMPLES = 64  # placements per iteration
LEARNING_RATE = 0.02  # Adam, per-group table
MLP_LEARNING_RATE = 0.001  # Adam, MLP
ENTROPY_WEIGHT = 0.01
PENALTY_FACTOR = 10.0
CONVERGED_FRESH = 0.05
PATIENCE = 10  # iterations without a faster placement before a restart around the best
WARM_DEVIATIONS = 2.0  # expected shifts off the best placement per sample at a restart

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class RLResult:
    assignment: tuple[int, ...]  # device per op
    step_time_s: float  # simulated, of ``assignment``
    iterations: int
    num_simulations: int  # placements simulated (cache hits excluded, the final check included)
    mean_reward: tuple[float, ...]  # per iteration: mean reward of its sampled placements
    elapsed_s: tuple[float, ...]  # per iteration: seconds since the search started, at its end
    best_step_s: tuple[float, ...]  # per iteration: the fastest fitting placement so far (inf: none yet)
    time_s: float


def rl_placement(
    problem: PlacementProblem,
    *,
    budget_s: float = 30.0,
    seed: int = 0,
    max_iterations: int | None = None,
    samples_per_iteration: int = SAMPLES,
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
    features = group_features(grouped)
    policy, optimizer = _fresh_policy(features, problem.num_devices, generator=generator, around=None)
    curve: list[float] = []
    elapsed: list[float] = []
    best: list[float] = []
    stale = 0
    while True:
        before_s, seen = judge.best_s, judge.num_simulations
        curve.append(_train_step(policy, optimizer, judge, generator, samples=samples_per_iteration))
        elapsed.append(time.perf_counter() - start)
        best.append(judge.best_s)
        converged = judge.num_simulations - seen <= CONVERGED_FRESH * samples_per_iteration
        stale = 0 if judge.best_s < before_s or not converged else stale + 1
        if stale >= PATIENCE and judge.best is not None:
            policy, optimizer = _fresh_policy(features, problem.num_devices, generator=generator, around=judge.best)
            stale = 0
        if progress is not None:
            progress("rl", len(curve), 0)
        exhausted = len(judge.cache) == problem.num_devices**count  # every placement simulated
        if exhausted or len(curve) == max_iterations or elapsed[-1] >= budget_s:
            break
    if judge.best is None:
        raise _nothing_fits(problem, judge.num_simulations, time.perf_counter() - start)
    assignment = tuple(judge.best[g] for g in groups)
    step_time_s = simulate_assignment(problem, assignment).step_time_s
    return RLResult(
        assignment=assignment,
        step_time_s=step_time_s,
        iterations=len(curve),
        num_simulations=judge.num_simulations + 1,
        mean_reward=tuple(curve),
        elapsed_s=tuple(elapsed),
        best_step_s=tuple(best),
        time_s=time.perf_counter() - start,
    )


def _fresh_policy(
    features: torch.Tensor, num_devices: int, *, generator: torch.Generator, around: tuple[int, ...] | None
) -> tuple[ShiftPolicy, torch.optim.Optimizer]:
    """A new policy and its optimizer; ``around``: its mode is that placement, drawn whole with probability
    about ``exp(−WARM_DEVIATIONS)``."""
    policy = ShiftPolicy(features, num_devices, generator=generator)
    if around is not None:
        count = features.shape[0]
        margin = math.log(max(1.0, count * (num_devices - 1) / WARM_DEVIATIONS - (num_devices - 1)))
        shifts = shifts_of(torch.tensor(around), num_devices)
        with torch.no_grad():
            policy.table.copy_(-policy.prior.expand(count, num_devices))
            policy.table[torch.arange(count), shifts] += margin
    optimizer = torch.optim.Adam(
        [
            {"params": [policy.table], "lr": LEARNING_RATE},
            {"params": [*policy.weights, *policy.biases], "lr": MLP_LEARNING_RATE},
        ]
    )
    return policy, optimizer


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
        link_latency_s=problem.link_latency_s,
        link_bandwidth=problem.link_bandwidth,
    )


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


@dataclass(kw_only=True)
class _Judge:
    """Rewards of group placements by batched simulation, cached; keeps the fastest placement that fits."""

    problem: PlacementProblem  # the grouped problem
    reference_s: float
    cache: dict[bytes, float] = field(default_factory=dict)  # placement (int64 bytes) -> R'
    num_simulations: int = 0
    best: tuple[int, ...] | None = None
    best_s: float = math.inf

    def rewards(self, placements: np.ndarray) -> np.ndarray:
        """``r`` of each row of ``placements`` (``(S, G)`` int64), simulating those not seen before at once."""
        keys = [row.tobytes() for row in placements]
        fresh = list({key: k for k, key in enumerate(keys) if key not in self.cache}.items())
        if fresh:
            rows = placements[[k for _, k in fresh]]
            result = simulate_placements(self.problem, rows)
            self.num_simulations += len(fresh)
            capacity = np.asarray(self.problem.device_memory_bytes)
            for (key, _), row, step_s, peak in zip(
                fresh, rows, result.step_time_s, result.peak_memory_bytes, strict=True
            ):
                overflow = overflow_ratio(peak, capacity)
                runtime = penalized_runtime(float(step_s), overflow)
                self.cache[key] = runtime
                if overflow <= 0 and runtime < self.best_s:
                    self.best, self.best_s = tuple(int(d) for d in row), runtime
        return np.array([reward(self.cache[key], self.reference_s) for key in keys])


def _train_step(
    policy: ShiftPolicy, optimizer: torch.optim.Optimizer, judge: _Judge, generator: torch.Generator, *, samples: int
) -> float:
    """One REINFORCE iteration: sample, judge, step Adam, judge the new mode; the mean reward of the samples."""
    num_devices = policy.prior.shape[0]
    log_probs = torch.log_softmax(policy(), dim=-1)  # (G, D)
    shifts = sample(log_probs, samples, generator=generator)  # (S, G)
    rewards = torch.from_numpy(judge.rewards(devices_of(shifts, num_devices).numpy()))
    spread = float(rewards.std()) if samples > 1 else 0.0
    advantage = ((rewards - rewards.mean()) / (spread + 1e-8)).to(log_probs.dtype)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1).mean()
    loss = -(advantage * log_prob(log_probs, shifts)).mean() - ENTROPY_WEIGHT * entropy
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        mode = policy().argmax(dim=-1, keepdim=True).T  # (1, G): the updated policy's most likely shifts
        judge.rewards(devices_of(mode, num_devices).numpy())
    return float(rewards.mean())


def _nothing_fits(problem: PlacementProblem, simulations: int, seconds: float) -> AutoplanError:
    low, high = min(problem.device_memory_bytes) / GIB, max(problem.device_memory_bytes) / GIB
    capacity = f"{low:.2f} GiB" if low == high else f"{low:.2f} to {high:.2f} GiB"
    return AutoplanError(
        f"{ALGORITHM}: no placement that fits in {capacity} per device found in {simulations} simulations "
        f"({seconds:.1f} s): raise --rl-budget-s, add devices or lower the batch"
    )
