"""How a plan synchronises gradients: exactly, or with a lossy choice the user allowed (``--allow-lossy``).

:class:`GradSync` is one field of the plan (``Plan.grad_sync``, JSON ``"grad_sync"``; a plan without it
syncs exactly). The kinds, each run with torch's own DDP communication hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) and model averagers:

* ``exact`` — the gradient all-reduce (sum of partial sums, or DDP's mean);
* ``bf16`` — every gradient bucket is cast to bf16 before its all-reduce and back after
  (``default_hooks.bf16_compress_hook``): 8 bits of mantissa instead of 24 in the summed gradient;
* ``powersgd`` — rank-``rank`` PowerSGD with error feedback (``powerSGD_hook.powerSGD_hook``): each matrix
  gradient ``M`` (n × m) is replaced by ``P·Qᵀ`` with ``P`` (n × r) and ``Q`` (m × r) all-reduced; 1-D
  gradients go uncompressed; exact all-reduce for the first ``warmup_steps`` steps;
* ``local-sgd`` — post-local SGD (``post_localSGD_hook`` + ``PeriodicModelAverager``): after
  ``warmup_steps`` exact steps each node's replicas average gradients among themselves only, and the
  parameters are averaged over every replica once every ``period`` steps.

Two more change the update itself:

* ``dgc`` ratio ``ρ`` — Deep Gradient Compression (Lin et al. 2018): top-k with momentum correction (the replicas
  keep SGD's momentum and accumulate it; the optimizer runs without it: ``sgd-momentum`` plans only), momentum
  factor masking and a warm-up of the sparsity (:mod:`executors.compressed_sync`);
* ``dga`` delay ``D`` — Delayed Gradient Averaging (Zhu et al. 2021): each replica steps on
  ``∇w(i) − ∇w(i−D) + avg ∇w(i−D)``, the average launched ``D`` steps before (:mod:`executors.delayed_sync`; DDP
  only);
* ``ps`` servers ``S`` (staleness ``K``) — a parameter server (Li et al. 2014, "Scaling Distributed Machine Learning
  with the Parameter Server"): the parameters are split into ``S`` shards, each held by one server rank
  co-located with a replica; every replica pushes each shard's gradient to its server, the server averages them,
  runs the optimizer on its shard (its optimizer state lives there only) and sends the parameters back
  (:mod:`executors.parameter_server`; DDP plans only). ``K = 0`` is synchronous: the same update as exact sync.
  ``K > 0`` is asynchronous with bounded staleness: the gradient of step ``t`` is applied at step ``t + K``, so a
  replica computes on parameters missing at most its last ``K`` updates and its push hides behind ``K`` steps.

The compressors of :mod:`executors.compressors` run in our own hook (:mod:`executors.compressed_sync`): each
rank compresses its bucket, the payloads are all-gathered (a sparse or quantized gradient cannot be summed on
the wire) and every rank decompresses and averages them:

* ``topk`` ratio ``ρ`` — Aji & Heafield (2017): the ``⌈ρ·N⌉`` largest-magnitude elements (values and indices),
  the rest kept in a per-bucket residual added to the next step's gradient (error feedback);
* ``onebit`` — Seide et al. (2014): one sign bit an element and two reconstruction values per column, with error
  feedback;
* ``threshold`` τ — Strom (2015): ``±τ`` for the elements with ``|x| ≥ τ``, the rest in the residual;
* ``terngrad`` — Wen et al. (2017): unbiased stochastic ternary levels ``{−s, 0, s}``, 2 bits an element;
* ``qsgd`` levels ``s`` — Alistarh et al. (2017): unbiased stochastic levels of the bucket's norm;
* ``signsgd`` — Bernstein et al. (2019): the majority vote of the replicas' signs, scaled by their mean
  ``‖g‖₁ / N`` (one number each) so that the step keeps the gradient's size.

:meth:`GradSync.parse` reads the command-line form (``exact``, ``bf16``, ``powersgd:4``, ``local-sgd:16``,
``topk:0.01``, ``onebit``, ``threshold:0.001``, ``terngrad``, ``qsgd:4``, ``signsgd``, ``dgc:0.001``, ``dga:4``,
``ps:4``, ``ps:4:2``: ``ps`` takes its servers and optionally its staleness);
:meth:`GradSync.describe` says what the choice changes numerically. Every kind but ``exact`` and ``bf16``
starts after ``warmup_steps`` exact steps; those that keep error feedback per bucket need at least 2, because
DDP rebuilds its buckets after its first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from planner.errors import AutoplanError
from planner.plan.codec import JsonCoded

GradSyncKind = Literal[
    "exact",
    "bf16",
    "powersgd",
    "local-sgd",
    "topk",
    "onebit",
    "threshold",
    "terngrad",
    "qsgd",
    "signsgd",
    "dgc",
    "dga",
    "ps",
]
GRAD_SYNC_KINDS: tuple[str, ...] = get_args(GradSyncKind)
DEFAULT_WARMUP_STEPS = 10  # exact steps before a compressing or local sync starts (PowerSGD needs at least 2)
# each kind's one parameter (the number after the colon on the command line); the others must stay 0
PARAMETER_OF: dict[str, str] = {
    "powersgd": "rank",
    "local-sgd": "period",
    "topk": "ratio",
    "threshold": "threshold",
    "qsgd": "levels",
    "dgc": "ratio",
    "dga": "delay",
    "ps": "servers",
}
SECOND_PARAMETER_OF: dict[str, str] = {"ps": "staleness"}  # an optional second number (``ps:S:K``), default 0
PARAMETER_LIMITS: dict[str, tuple[float, float]] = {  # (exclusive low, inclusive high)
    "rank": (0, float("inf")),
    "period": (0, float("inf")),
    "ratio": (0, 1),
    "threshold": (0, float("inf")),
    "levels": (0, 127),  # a level and its sign packed in 8 bits at most
    "delay": (0, 1000),
    "servers": (0, 100_000),
}
INTEGER_PARAMETERS = frozenset({"rank", "period", "levels", "delay", "servers", "staleness"})
MAX_STALENESS = 1000
NOUNS = {"servers": "server count"}  # a parameter's name in an error, where it is not a singular noun
# state kept per bucket (residuals, momenta, delayed averages): DDP's buckets must have been rebuilt first
ERROR_FEEDBACK_KINDS = frozenset({"powersgd", "topk", "onebit", "threshold", "dgc", "dga"})
GATHERED_KINDS = frozenset({"topk", "onebit", "threshold", "terngrad", "qsgd", "signsgd", "dgc"})  # all-gathered


class GradSyncError(AutoplanError):
    """A gradient-sync choice that is malformed or that a plan cannot run."""


@dataclass(frozen=True, kw_only=True)
class GradSync(JsonCoded):
    """How the plan synchronises gradients: exactly, or the lossy way the user allowed (the module docstring)."""

    kind: GradSyncKind = "exact"
    rank: int = 0  # powersgd: the matrix approximation rank r
    period: int = 0  # local-sgd: steps between two parameter averages H
    ratio: float = 0.0  # topk: the share of elements sent
    threshold: float = 0.0  # threshold: τ
    levels: int = 0  # qsgd: the levels s
    delay: int = 0  # dga: the steps D an average arrives late
    servers: int = 0  # ps: the server shards S
    staleness: int = 0  # ps: the steps K a gradient is applied late (0: synchronous)
    warmup_steps: int = 0  # every kind but exact and bf16: exact steps first (start_powerSGD_iter, …)

    def __post_init__(self) -> None:
        if self.kind not in GRAD_SYNC_KINDS:
            raise GradSyncError(f"unknown gradient sync {self.kind!r}: use one of {', '.join(GRAD_SYNC_KINDS)}")
        own = PARAMETER_OF.get(self.kind)
        for name, (low, high) in PARAMETER_LIMITS.items():
            value = getattr(self, name)
            if name == own and not low < value <= high:
                bound = "positive" if high == float("inf") else f"in ({low:g}, {high:g}]"
                raise GradSyncError(f"gradient sync {self.kind}: its {name} must be {bound}, got {value:g}")
            if name != own and value != 0:
                raise GradSyncError(f"gradient sync {self.kind} takes no {name} (got {value})")
        if self.staleness and self.kind not in SECOND_PARAMETER_OF:
            raise GradSyncError(f"gradient sync {self.kind} takes no staleness (got {self.staleness})")
        if not 0 <= self.staleness <= MAX_STALENESS:
            raise GradSyncError(f"gradient sync {self.kind}: its staleness must be in [0, {MAX_STALENESS}]")
        if self.warmup_steps < 0 or (self.kind in ERROR_FEEDBACK_KINDS and self.warmup_steps < 2):
            raise GradSyncError(
                f"gradient sync {self.kind} needs at least 2 exact warm-up steps: it keeps error feedback per bucket "
                "and DDP rebuilds its buckets after the first step"
            )
        if self.kind == "dga" and self.warmup_steps < self.delay:
            raise GradSyncError(
                f"dga:{self.delay} needs at least {self.delay} exact warm-up steps (one per step of delay)"
            )

    @property
    def parameter(self) -> float:
        """The kind's one parameter (0 for the kinds without one)."""
        own = PARAMETER_OF.get(self.kind)
        return getattr(self, own) if own else 0

    @property
    def error_feedback(self) -> bool:
        """The sync keeps a residual per bucket (its memory: one buffer the bucket's size)."""
        return self.kind in ERROR_FEEDBACK_KINDS

    @property
    def gathered(self) -> bool:
        """Each rank's compressed payload is all-gathered and every rank decompresses them all."""
        return self.kind in GATHERED_KINDS

    @property
    def lossy(self) -> bool:
        """Any sync but the exact all-reduce (what ``--allow-lossy`` opens); see :attr:`same_update`."""
        return self.kind != "exact"

    @property
    def same_update(self) -> bool:
        """The optimizer sees exact sync's gradient (summed in another order): exact, and a synchronous parameter
        server; ``--check-parity`` can compare these with one process."""
        return self.kind == "exact" or (self.kind == "ps" and self.staleness == 0)

    @property
    def label(self) -> str:
        """The command-line form: ``exact``, ``bf16``, ``powersgd:4``, ``local-sgd:16``, ``topk:0.01``, …"""
        own = PARAMETER_OF.get(self.kind)
        if self.kind == "ps" and self.staleness:
            return f"ps:{self.servers}:{self.staleness}"
        return f"{self.kind}:{getattr(self, own):g}" if own else self.kind

    @classmethod
    def parse(cls, text: str) -> GradSync:
        """``KIND`` or ``KIND:PARAMETER`` (module docstring); warm-up :data:`DEFAULT_WARMUP_STEPS` where it applies."""
        kind, _, number = text.strip().partition(":")
        forms = (
            "exact, bf16, powersgd:R, local-sgd:H, topk:RATIO, onebit, threshold:TAU, terngrad, qsgd:S, signsgd, "
            "dgc:RATIO, dga:D, ps:S, ps:S:K"
        )
        if kind not in GRAD_SYNC_KINDS:
            raise GradSyncError(f"--grad-sync {text!r}: use one of {forms}")
        own = PARAMETER_OF.get(kind)
        if (own is None) != (not number):
            raise GradSyncError(
                f"--grad-sync {text!r}: " + (f"{kind} takes a {NOUNS.get(own, own)}" if own else f"{kind} takes none")
            )
        number, _, second = number.partition(":") if kind in SECOND_PARAMETER_OF else (number, "", "")
        if second and not second.isdigit():
            raise GradSyncError(f"--grad-sync {text!r}: {SECOND_PARAMETER_OF[kind]} {second!r} is not an integer")
        extra = {SECOND_PARAMETER_OF[kind]: int(second)} if second else {}
        warmup = 0 if kind in ("exact", "bf16", "ps") else DEFAULT_WARMUP_STEPS
        if kind == "dga" and number.isdigit():
            warmup = max(warmup, int(number) + 1)
        if own is None:
            return cls(kind=kind, warmup_steps=warmup)
        try:
            value = int(number) if own in INTEGER_PARAMETERS else float(number)
        except ValueError:
            kind_of_number = "an integer" if own in INTEGER_PARAMETERS else "a number"
            raise GradSyncError(f"--grad-sync {text!r}: {own} {number!r} is not {kind_of_number}") from None
        try:
            return cls(kind=kind, warmup_steps=warmup, **{own: value}, **extra)
        except GradSyncError as error:
            raise GradSyncError(f"--grad-sync {text!r}: {error}") from None

    def describe(self) -> str:
        """What the choice changes in the numbers the optimizer sees, in one sentence."""
        if self.kind == "bf16":
            return "gradients are all-reduced in bf16 (cast before, back after: 8-bit mantissa sums)"
        if self.kind == "powersgd":
            return (
                f"matrix gradients are all-reduced as rank-{self.rank} PowerSGD factors P·Qᵀ with error feedback "
                f"(1-D gradients exact), after {self.warmup_steps} exact steps"
            )
        if self.kind == "local-sgd":
            return (
                f"after {self.warmup_steps} exact steps, gradients are averaged within each node only and the "
                f"parameters over every replica once every {self.period} steps (post-local SGD)"
            )
        if self.kind == "ps":
            return self._describe_ps()
        if self.kind in DESCRIPTIONS:
            return DESCRIPTIONS[self.kind].format(p=self.parameter) + f", after {self.warmup_steps} exact steps"
        return "gradients are synchronised exactly"

    def _describe_ps(self) -> str:
        shards = f"{self.servers} parameter server{'s' if self.servers > 1 else ''}"
        if not self.staleness:
            return (
                f"{shards} average the replicas' gradients and run the optimizer on their shards: the same update "
                "as exact sync (summed in another order)"
            )
        return (
            f"{shards} apply each step's averaged gradient {self.staleness} step{'s' if self.staleness > 1 else ''} "
            "late (bounded staleness): the replicas compute on parameters missing their last "
            f"{self.staleness} update{'s' if self.staleness > 1 else ''}"
        )


DESCRIPTIONS: dict[str, str] = {
    "topk": "each replica sends the largest {p:.2%} of its gradient's elements (values and indices), the rest "
    "kept as residual for later steps (Aji & Heafield 2017)",
    "onebit": "each replica sends one sign bit an element and two values per column, the quantization error kept "
    "as residual for later steps (Seide et al. 2014)",
    "threshold": "each replica sends ±{p:g} for the elements at least {p:g} in size, the rest kept as residual "
    "(Strom 2015)",
    "terngrad": "each replica sends stochastic ternary levels of its gradient's largest magnitude: unbiased, with "
    "added variance (Wen et al. 2017)",
    "qsgd": "each replica sends its gradient quantized to {p:g} stochastic levels of its norm: unbiased, with added "
    "variance (Alistarh et al. 2017)",
    "dgc": "Deep Gradient Compression (Lin et al. 2018): each replica keeps the momentum (the optimizer runs without "
    "it), accumulates it locally and sends its largest {p:.2%} (warm-up of the sparsity, momentum factor masking; "
    "local clipping to the program's --max-grad-norm on data-parallel plans)",
    "dga": "Delayed Gradient Averaging (Zhu et al. 2021): each replica steps on its own gradient, corrected by the "
    "average from {p:g} steps before (∇w(i) − ∇w(i−D) + avg ∇w(i−D)): the average arrives D steps late",
    "signsgd": "the replicas' gradient signs are majority-voted and scaled by their mean magnitude: every element "
    "moves by the same amount (Bernstein et al. 2019)",
}
