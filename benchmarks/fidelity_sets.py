"""What ``benchmarks/fidelity.py`` fits on, what it scores on, and which timing attempt it keeps.

*Probe set* (fitted): the narrow residual MLP ``calibration/probe_model.py`` under the
configurations of :data:`calibration.probes.PROBES` — what ``plan calibrate`` runs to
fit the executors' host overheads (per operator, per sharded operator, per microbatch, per step,
per message) — and, under the profiled cost model, ``examples/mlp.py`` at real widths
(:data:`calibration.probes.COMPUTE_PROBES`, for the compute contention); plus the raw
machine measurements (matmul, memory, gloo collectives).

*Scored set* (:data:`SCORED`, held out): GPT, ResNet, MoE and models of the Hugging Face / ``nn``
zoo, under data parallel, Megatron tensor and pipeline (GPipe, 1F1B), auto and hash. No scored
model file is a probe model file (:func:`check_disjoint`), so no scored plan was fitted on.

Keep rule (:func:`keep`, :func:`pick_timing`), blind to the error: every world's plans are timed
``attempts`` times (one torchrun job each); around each plan's timed steps the job records the share
of all CPU time the VM's host stole (``steal`` in /proc/stat) and the share other processes on this
machine used (busy ticks less our ranks' own CPU time: :func:`executors.measure.step_timing.machine_shares`),
and per plan the timing with the least ``steal + foreign`` share is kept (ties: the earlier attempt).
The rule sees only those shares, never an estimate, so it cannot pick the timing that fits best.

Per world (:func:`world_summary`): MAPE ``= mean |p/m − 1|``, the worst row, rows within 20%, and
Spearman's ρ between predicted and measured step times of that world's rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE_MODEL_FILES = ("calibration/probe_model.py", "examples/mlp.py")

GPT = {"layers": 4, "hidden": 256, "heads": 4, "seq": 64, "vocab": 2048}
RESNET = {"width": 16, "blocks": 1, "stages": 3, "image_size": 32}
MOE = {"hidden": 128, "experts": 4, "top_k": 2, "layers": 2, "tokens": 32}
BERT = {"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "vocab": 1024}
LLAMA = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "seq": 64, "vocab": 1024}
LSTM = {"vocab": 1024, "hidden": 256, "layers": 2, "seq": 32}


@dataclass(frozen=True, kw_only=True)
class Case:
    """One scored plan: ``model`` (path under ``examples/``), its args, batch, method, planner options
    (``degrees`` "tensor" = ``(world, 1, 1)``, "pipeline" = ``(1, 2, world / 2)``)."""

    model: str
    args: Mapping[str, object]
    batch: int
    method: str
    options: Mapping[str, object] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return ROOT / "examples" / self.model

    def planner_options(self, world: int) -> dict[str, object]:
        options = dict(self.options)
        if options.get("degrees") == "tensor":
            options["degrees"] = (world, 1, 1)
        elif options.get("degrees") == "pipeline":
            options["degrees"] = (1, 2, world // 2)
        return options


def _pipe(schedule: str, microbatches: int) -> dict[str, object]:
    return {"degrees": "pipeline", "schedule": schedule, "microbatches": microbatches}


TENSOR = {"degrees": "tensor"}
ZERO_BUBBLE = {"schedule": "zero-bubble", "microbatches": 4}
SCORED: dict[str, Case] = {
    "gpt-dp": Case(model="gpt.py", args=GPT, batch=8, method="data-parallel"),
    "gpt-tp": Case(model="gpt.py", args=GPT, batch=8, method="megatron", options=TENSOR),
    "gpt-1f1b": Case(model="gpt.py", args=GPT, batch=8, method="megatron", options=_pipe("1f1b", 4)),
    "gpt-auto": Case(model="gpt.py", args=GPT, batch=8, method="auto"),
    "resnet-dp": Case(model="resnet.py", args=RESNET, batch=32, method="data-parallel"),
    "resnet-gpipe": Case(model="resnet.py", args=RESNET, batch=32, method="megatron", options=_pipe("gpipe", 4)),
    "moe-dp": Case(model="moe.py", args=MOE, batch=16, method="data-parallel"),
    "moe-tp": Case(model="moe.py", args=MOE, batch=16, method="megatron", options=TENSOR),
    "bert-tp": Case(model="zoo/hf_bert.py", args=BERT, batch=16, method="megatron", options=TENSOR),
    "bert-auto": Case(model="zoo/hf_bert.py", args=BERT, batch=16, method="auto"),
    "llama-dp": Case(model="zoo/hf_llama.py", args=LLAMA, batch=16, method="data-parallel"),
    "llama-1f1b": Case(model="zoo/hf_llama.py", args=LLAMA, batch=16, method="megatron", options=_pipe("1f1b", 4)),
    # issue 20's choices: schedules the probes never run, and FSDP
    "gpt-interleaved": Case(model="gpt.py", args=GPT, batch=8, method="megatron", options=_pipe("interleaved", 4)),
    "gpt-zero-bubble": Case(model="gpt.py", args=GPT, batch=8, method="uniform-pipeline", options=ZERO_BUBBLE),
    "llama-fsdp": Case(model="zoo/hf_llama.py", args=LLAMA, batch=16, method="data-parallel", options={"zero": "3"}),
    "lstm-dp": Case(model="zoo/nn_lstm.py", args=LSTM, batch=16, method="data-parallel"),
    "lstm-hash": Case(model="zoo/nn_lstm.py", args=LSTM, batch=16, method="hash"),
}


def probe_set(*, profiled: bool = True) -> dict[str, str]:
    """The fitted configurations: probe name -> description (model file, size, batch, method)."""
    from calibration.probes import COMPUTE_PROBES, PROBES

    def extra(options: Mapping[str, object]) -> str:
        return f" ({', '.join(f'{k} {v}' for k, v in options.items())})" if options else ""

    rows = {}
    for name, (width, layers, activations, batch, method, options) in PROBES.items():
        rows[name] = (
            f"{PROBE_MODEL_FILES[0]} width {width}, {layers} blocks of {activations} GELU, batch {batch}, "
            f"{method}{extra(options)}"
        )
    if profiled:
        for name, (hidden, layers, batch, method, options) in COMPUTE_PROBES.items():
            rows[name] = (
                f"{PROBE_MODEL_FILES[1]} hidden {hidden}, {layers} blocks, batch {batch}, {method}{extra(options)}"
            )
    return rows


def check_disjoint(scored: Mapping[str, Case] = SCORED, probe_files: Sequence[str] = PROBE_MODEL_FILES) -> None:
    """Raise when a scored case runs a probe model file: the score would include fitted plans."""
    probes = {(ROOT / f).resolve() for f in probe_files}
    shared = sorted(name for name, case in scored.items() if case.path.resolve() in probes)
    if shared:
        raise ValueError(f"scored cases {shared} run a probe model: the score must be held out")


@dataclass(frozen=True, kw_only=True)
class Timing:
    """One plan's timed steps in one attempt, and what else ran on the machine meanwhile."""

    attempt: int
    measured_s: float  # median step seconds
    steal_share: float  # CPU time the VM's host took / all CPU time, over the plan's timed steps
    foreign_share: float  # CPU time other processes here took / all CPU time, same window

    @property
    def disturbance(self) -> float:
        return self.steal_share + self.foreign_share


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One timing run (one torchrun job) of a world's plans."""

    world: int
    index: int
    timings: Mapping[str, Timing]  # case key -> its timing in this run
    load_before: float  # 1-minute load average before the run
    load_after: float
    wall_s: float


def pick_timing(timings: Sequence[Timing]) -> Timing:
    """The timing with the least stolen + foreign CPU share (then the earlier attempt): blind to the error."""
    if not timings:
        raise ValueError("no timing to pick from")
    return min(timings, key=lambda t: (round(t.disturbance, 3), t.attempt))


def keep(attempts: Sequence[Attempt]) -> dict[str, Timing]:
    """Per case key, the timing :func:`pick_timing` keeps among the attempts."""
    keys = dict.fromkeys(key for attempt in attempts for key in attempt.timings)
    return {key: pick_timing([a.timings[key] for a in attempts if key in a.timings]) for key in keys}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's ρ (average ranks for ties)."""

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


@dataclass(frozen=True, kw_only=True)
class WorldSummary:
    world: int
    rows: int
    mape: float
    worst_key: str
    worst_error: float  # signed
    within_20: int
    within_30: int
    spearman: float


def world_summary(world: int, predicted: Mapping[str, float], measured: Mapping[str, float]) -> WorldSummary:
    """MAPE, worst row, rows within 20% and 30%, and Spearman over one world's rows."""
    keys = list(predicted)
    errors = {k: predicted[k] / measured[k] - 1 for k in keys}
    worst = max(keys, key=lambda k: abs(errors[k]))
    return WorldSummary(
        world=world,
        rows=len(keys),
        mape=statistics.fmean(abs(e) for e in errors.values()),
        worst_key=worst,
        worst_error=errors[worst],
        within_20=sum(abs(e) <= 0.2 for e in errors.values()),
        within_30=sum(abs(e) <= 0.3 for e in errors.values()),
        spearman=spearman([predicted[k] for k in keys], [measured[k] for k in keys]),
    )
