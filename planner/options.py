"""What the user asked for, as one frozen value: :class:`PlanOptions`.

The ``plan`` command builds it once from its parsed flags (:func:`planner.cli.options.plan_options`) and the
library once from the keyword arguments of :func:`planner.api.plan` (``PlanOptions(**options)``); either way it
is checked here, when it is built — a bad value is an :class:`~planner.errors.AutoplanError` naming the flag, one
line, exit code 2 from the command — and then passed whole to everything that reads an option: the capture and
cost setup (:mod:`planner.preparation`), the method registry (:mod:`planner.methods`), the two-level search
(:mod:`planner.inter.search`), auto (:mod:`planner.auto`) and the baselines (:mod:`planner.baselines`).

The choices are :class:`enum.StrEnum` members: each *is* its command-line string, so comparisons, JSON and
printed text read exactly as the strings did. ``space=alpa`` narrows the options to Alpa's search space here
(:meth:`PlanOptions.__post_init__`): recomputation all or nothing per stage, no ZeRO, no CPU offload.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

from cost_models.cluster import Cluster
from planner.costing.runtime_profiles import OUR_RUNTIME, PROFILES
from planner.costing.setup import COST_MODELS
from planner.errors import AutoplanError
from planner.plan import GradSync, Method

HANDWRITTEN_METHODS = (Method.DATA_PARALLEL, Method.MEGATRON, Method.UNIFORM_PIPELINE)  # each also auto's candidate
PLACEMENT_METHODS = (Method.HASH, Method.CRITICAL_PATH, Method.MULTI_OBJECTIVE, Method.M_ETF, Method.RL)


class ScheduleChoice(enum.StrEnum):
    """``--schedule``: auto prices the schedules and keeps the fastest; any other forces it."""

    AUTO = "auto"
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero-bubble"


class RematChoice(enum.StrEnum):
    """``--remat``: which recomputation each stage may run (``on``: full, what it meant before selective
    recomputation; ``off-or-full``: each stage all or nothing, Alpa's choice)."""

    AUTO = "auto"
    OFF = "off"
    ATTENTION = "attention"
    FULL = "full"
    ON = "on"
    OFF_OR_FULL = "off-or-full"


class ZeroChoice(enum.StrEnum):
    """``--zero``: one ZeRO level for every stage with data-parallel axes, or auto (the search's per stage)."""

    AUTO = "auto"
    OFF = "0"
    OPTIMIZER_STATE = "1"
    GRADIENTS = "2"
    PARAMETERS = "3"


class OffloadChoice(enum.StrEnum):
    """``--offload``: FSDP2's CPU offload of the parameter, gradient and optimizer-state shards (the optimizer
    stepping on the CPU, :mod:`planner.costing.offload`) on a data-parallel plan: auto only when no plan fits
    without it; on: the data-parallel plan with it; off: never."""

    AUTO = "auto"
    OFF = "off"
    ON = "on"


class SearchSpace(enum.StrEnum):
    """``--space``: everything auto can search, or only Alpa's space (to measure what the rest adds)."""

    FULL = "full"
    ALPA = "alpa"


class Tracer(enum.StrEnum):
    EXPORT = "export"
    FX = "fx"


ALPA_SCHEDULES = (ScheduleChoice.AUTO, ScheduleChoice.ONE_F_ONE_B, ScheduleChoice.GPIPE)
Choice = TypeVar("Choice", bound=enum.StrEnum)


def parse_method(name: object) -> Method:
    """``name`` as a :class:`Method`, or the one-line error listing the methods."""
    try:
        return Method(str(name))
    except ValueError:
        raise AutoplanError(f"unknown method {name!r}: use one of {', '.join(Method)}") from None


def _choice(kind: type[Choice], value: object, flag: str) -> Choice:
    """``value`` as a member of ``kind``, or the one-line error naming ``flag`` and its choices."""
    try:
        return kind(str(value))
    except ValueError:
        raise AutoplanError(f"{flag} must be one of {', '.join(kind)}, got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Every planner option, checked when built; the keyword names are :func:`planner.api.plan`'s."""

    method: Method = Method.AUTO
    tracer: Tracer = Tracer.EXPORT
    optimizer: str | None = None  # None: the cluster's default (planner.costing.setup.default_optimizer)
    cost_model: str = "roofline"
    memory_fraction: float = 1.0
    runtime: str = OUR_RUNTIME
    max_stages: int | None = None
    microbatches: int | None = None  # None: search the counts of planner.inter.search.microbatch_counts
    schedule: ScheduleChoice = ScheduleChoice.AUTO
    remat: RematChoice = RematChoice.AUTO
    zero: ZeroChoice = ZeroChoice.AUTO
    offload: OffloadChoice = OffloadChoice.AUTO  # CPU offload under FSDP (planner.baselines.offloaded)
    allow_lossy: bool = False  # candidates may also run a lossy gradient sync (grad_sync_choice)
    grad_sync: GradSync | None = None  # every candidate runs this one (None: exact, or the choice); text parsed
    space: SearchSpace = SearchSpace.FULL
    ilp_time_limit_s: float = 30.0
    degrees: tuple[int, int, int] | None = None  # megatron: evaluate this (tensor, pipeline, data) only
    # processes for the search's independent work (planner.inter.forked); the plan command's default is the cores
    jobs: int = 1
    rl_budget_s: float = 30.0
    rl_iterations: int | None = None  # None: until the budget is spent
    seed: int = 0

    def __post_init__(self) -> None:
        self._set_choices()
        self._check_numbers()
        grad_sync = GradSync.parse(self.grad_sync) if isinstance(self.grad_sync, str) else self.grad_sync
        if grad_sync is not None and not grad_sync.same_update and not self.allow_lossy:
            raise AutoplanError(
                f"--grad-sync {grad_sync.label} changes the gradients the optimizer sees: add --allow-lossy"
            )
        object.__setattr__(self, "grad_sync", grad_sync)
        if self.offload == OffloadChoice.ON and self.zero == ZeroChoice.OFF:
            raise AutoplanError("--offload on runs under FSDP, which shards the state: use --zero 1, 2, 3 or auto")
        if self.runtime not in PROFILES:
            raise AutoplanError(f"--runtime must be one of {', '.join(PROFILES)}, got {self.runtime!r}")
        self._narrow_to_space()
        if self.cost_model not in COST_MODELS:
            raise AutoplanError(f"unknown cost model {self.cost_model!r}: use one of {', '.join(COST_MODELS)}")

    def _set_choices(self) -> None:
        """Strings (the API's and the command line's) as their enum members; an unknown one names its flag."""
        object.__setattr__(self, "method", parse_method(self.method))
        for name, kind, flag in (
            ("tracer", Tracer, "--tracer"),
            ("schedule", ScheduleChoice, "--schedule"),
            ("remat", RematChoice, "--remat"),
            ("zero", ZeroChoice, "--zero"),
            ("offload", OffloadChoice, "--offload"),
            ("space", SearchSpace, "--space"),
        ):
            object.__setattr__(self, name, _choice(kind, getattr(self, name), flag))
        if self.degrees is not None:
            object.__setattr__(self, "degrees", tuple(self.degrees))

    def _check_numbers(self) -> None:
        if self.max_stages is not None and self.max_stages < 1:
            raise AutoplanError(f"--max-stages must be at least 1, got {self.max_stages}")
        if self.jobs < 1:
            raise AutoplanError(f"--jobs must be at least 1, got {self.jobs}")
        if self.rl_budget_s <= 0:
            raise AutoplanError(f"--rl-budget-s must be positive, got {self.rl_budget_s:g}")
        if self.rl_iterations is not None and self.rl_iterations < 1:
            raise AutoplanError(f"--rl-iterations must be at least 1, got {self.rl_iterations}")
        if not 0 < self.memory_fraction <= 1:
            raise AutoplanError(
                f"--memory-fraction must be in (0, 1] (a share of the usable memory), got {self.memory_fraction}"
            )

    def _narrow_to_space(self) -> None:
        """``--space alpa``: Alpa's search space (Zheng et al. 2022): GPipe or 1F1B, each stage recomputing all
        its layers or none, no ZeRO; sequence parallelism (planner.intra.stage_problem) and schedule variants
        (planner.inter.schedule_variants) are off. An option outside it is an error."""
        if self.space == SearchSpace.FULL:
            return
        outside = [
            *([f"--schedule {self.schedule}"] if self.schedule not in ALPA_SCHEDULES else []),
            *([f"--remat {self.remat}"] if self.remat == RematChoice.ATTENTION else []),
            *([f"--zero {self.zero}"] if self.zero not in (ZeroChoice.AUTO, ZeroChoice.OFF) else []),
            *(["--allow-lossy"] if self.allow_lossy else []),
            *(["--offload on"] if self.offload == OffloadChoice.ON else []),
        ]
        if outside:
            raise AutoplanError(f"{', '.join(outside)} is outside --space alpa: drop it or use --space full")
        if self.remat == RematChoice.AUTO:
            object.__setattr__(self, "remat", RematChoice.OFF_OR_FULL)
        object.__setattr__(self, "zero", ZeroChoice.OFF)
        object.__setattr__(self, "offload", OffloadChoice.OFF)

    def check_cluster(self, cluster: Cluster) -> None:
        """A clear error unless ``--degrees (t, p, d)`` is a Megatron configuration of ``cluster``."""
        if self.degrees is None:
            return
        t, p, d = self.degrees
        if min(self.degrees) < 1 or t * p * d != cluster.num_devices:
            raise AutoplanError(
                f"--degrees {t},{p},{d} uses {t * p * d} devices, the cluster has {cluster.num_devices}: "
                "tensor × pipeline × data must equal the device count"
            )
        if cluster.devices_per_node % t:
            raise AutoplanError(
                f"--degrees {t},{p},{d}: tensor degree {t} must divide the {cluster.devices_per_node} devices per "
                "node (tensor parallel groups stay inside a node)"
            )

    def asked_choices(self) -> str:
        """The choices the user fixed, in words (``--degrees 2,1,4, ZeRO-3, selective recomputation``); empty if
        none."""
        remat = {
            RematChoice.OFF: "no recomputation",
            RematChoice.ON: "full recomputation",
            RematChoice.FULL: "full recomputation",
            RematChoice.ATTENTION: "selective recomputation",
        }.get(self.remat)
        zero = (
            [] if self.zero == ZeroChoice.AUTO else ["no ZeRO" if self.zero == ZeroChoice.OFF else f"ZeRO-{self.zero}"]
        )
        choices = [
            *([f"--degrees {','.join(map(str, self.degrees))}"] if self.degrees else []),
            *zero,
            *(["CPU offload"] if self.offload == OffloadChoice.ON else []),
            *([remat] if remat else []),
            *([f"{self.microbatches} microbatches"] if self.microbatches else []),
            *([f"schedule {self.schedule}"] if self.schedule != ScheduleChoice.AUTO else []),
            *([f"at most {self.max_stages} stages"] if self.max_stages else []),
        ]
        return ", ".join(choices)
