"""A plan in Megatron-LM's vocabulary: global batch, micro-batch size per replica, TP/PP/DP/VPP, tokens/s per GPU.

:func:`megatron_terms` derives them from the plan; nothing here is stored for its own sake. The plan's JSON carries
them as a read-only ``megatron`` block that :meth:`planner.plan.value.Plan.to_json` writes on every save and
:meth:`~planner.plan.value.Plan.from_json` ignores (recomputed from the plan, so the block can never disagree
with the plan it describes). The terms, as Megatron-LM's arguments name them:

* *global batch size* (``--global-batch-size``): the rows of one optimizer step, over all replicas (the plan's
  ``batch_size``);
* *micro-batch size* (``--micro-batch-size``): the rows **one data-parallel replica** processes per microbatch,
  ``global batch / (microbatches · DP)`` — not the rows of a microbatch across the replicas
  (``global batch / microbatches``), which our summary calls a microbatch's rows;
* *number of microbatches*: ``global batch / (micro-batch size · DP)``;
* *TP* and *DP*: the products of a stage's tensor and data mesh axes (:func:`planner.plan.stage.stage_degrees`);
  *PP*: the pipeline ranks (``Plan.num_pipeline_ranks``); *VPP*: virtual stages per pipeline rank
  (``Plan.virtual_stages``, 1 without interleaving). Stages of different degrees (a plan Megatron-LM cannot
  express) leave TP, DP and the micro-batch size ``None`` and list them per stage (``per_stage``); an operator
  placement (``dataflow``) has no degrees at all;
* *sequence length*: the second dim of the model's first input when it is a ``batch × sequence`` integer tensor
  (``ModelRef.sequence_length``);
* *tokens/s per GPU* (or samples/s per GPU when the input is not tokens): the global batch's tokens (samples) over
  the estimated step and the plan's devices; *MFU*: the estimate's.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan.codec import JsonCoded
from planner.plan.schedules import Schedule
from planner.plan.stage import Stage, stage_degrees


@dataclass(frozen=True, kw_only=True)
class StageTerms(JsonCoded):
    """One stage's tensor and data degrees and micro-batch size per replica (plans whose stages differ)."""

    stage: int
    tensor_parallel: int
    data_parallel: int
    micro_batch_size: int | None  # None: a microbatch's rows do not split evenly over the replicas


@dataclass(frozen=True, kw_only=True)
class MegatronTerms(JsonCoded):
    """The plan in Megatron-LM's words, derived from the plan (read-only: written beside it, recomputed on load)."""

    global_batch_size: int
    num_microbatches: int
    micro_batch_size: int | None  # rows per replica per microbatch; None: stages differ (per_stage), or uneven
    tensor_parallel: int | None  # None: stages differ (per_stage), or an operator placement
    pipeline_parallel: int | None  # None: an operator placement
    data_parallel: int | None
    virtual_pipeline_parallel: int | None
    sequence_length: int | None  # None: the first input is not batch × sequence token ids
    samples_per_s_per_gpu: float
    tokens_per_s_per_gpu: float | None
    mfu: float
    per_stage: tuple[StageTerms, ...] = ()  # only when the stages' degrees differ


def micro_batch_size(*, batch_size: int, num_microbatches: int, data_parallel: int) -> int | None:
    """Rows one of ``data_parallel`` replicas processes per microbatch; None when they do not split evenly."""
    rows = batch_size // num_microbatches
    return rows // data_parallel if rows % data_parallel == 0 else None


@dataclass(frozen=True, kw_only=True)
class PlanFigures:
    """What the terms are computed from: the plan's batch, schedule, stages and estimate (``Plan.megatron``
    passes its own fields, so this module needs no :class:`~planner.plan.value.Plan`)."""

    batch_size: int
    num_microbatches: int
    schedule: Schedule
    stages: tuple[Stage, ...]
    num_devices: int
    num_pipeline_ranks: int
    virtual_stages: int
    sequence_length: int | None
    step_time_s: float
    mfu: float

    def micro_batch_size(self, data_parallel: int) -> int | None:
        return micro_batch_size(
            batch_size=self.batch_size, num_microbatches=self.num_microbatches, data_parallel=data_parallel
        )


def _stage_terms(figures: PlanFigures, stage: Stage) -> StageTerms:
    degrees = stage_degrees(stage)
    return StageTerms(
        stage=stage.index,
        tensor_parallel=degrees.tensor,
        data_parallel=degrees.data,
        micro_batch_size=figures.micro_batch_size(degrees.data),
    )


def megatron_terms(figures: PlanFigures) -> MegatronTerms:
    """The plan's global batch, micro-batch size per replica, degrees, sequence length, throughput and MFU."""
    step, devices = figures.step_time_s, max(1, figures.num_devices)
    samples = figures.batch_size / step / devices if step > 0 else 0.0
    sequence = figures.sequence_length
    common = {
        "global_batch_size": figures.batch_size,
        "num_microbatches": figures.num_microbatches,
        "sequence_length": sequence,
        "samples_per_s_per_gpu": samples,
        "tokens_per_s_per_gpu": samples * sequence if sequence else None,
        "mfu": figures.mfu,
    }
    if figures.schedule == Schedule.DATAFLOW:  # every operator whole on one device: one replica, no degrees
        return MegatronTerms(
            micro_batch_size=figures.micro_batch_size(1),
            tensor_parallel=None,
            pipeline_parallel=None,
            data_parallel=None,
            virtual_pipeline_parallel=None,
            **common,
        )
    stages = [_stage_terms(figures, stage) for stage in sorted(figures.stages, key=lambda stage: stage.index)]
    same = len({(terms.tensor_parallel, terms.data_parallel) for terms in stages}) == 1
    return MegatronTerms(
        micro_batch_size=stages[0].micro_batch_size if same else None,
        tensor_parallel=stages[0].tensor_parallel if same else None,
        pipeline_parallel=figures.num_pipeline_ranks,
        data_parallel=stages[0].data_parallel if same else None,
        virtual_pipeline_parallel=figures.virtual_stages,
        per_stage=() if same else tuple(stages),
        **common,
    )


def _rate(value: float) -> str:
    """``7,890``, ``12.3``, ``0.0456``: three significant figures, thousands separated."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def _degrees_words(terms: MegatronTerms) -> str:
    if terms.pipeline_parallel is None:
        return "operator placement (no TP/PP/DP degrees)"
    if terms.per_stage:
        mixed = ", ".join(f"{stage.tensor_parallel}×{stage.data_parallel}" for stage in terms.per_stage)
        micro = ", ".join("uneven" if s.micro_batch_size is None else str(s.micro_batch_size) for s in terms.per_stage)
        return f"TP×DP per stage (mixed) {mixed}, PP {terms.pipeline_parallel}, micro-batch size per stage {micro}"
    return f"TP {terms.tensor_parallel}, PP {terms.pipeline_parallel}, DP {terms.data_parallel}"


def megatron_terms_text(terms: MegatronTerms, *, per: str = "GPU") -> str:
    """One line: ``Megatron-LM terms: global batch 32, micro-batch size 1, 8 microbatches, TP 1, PP 4, DP 4, VPP 2,
    sequence length 1024; 7,890 tokens/s per GPU, MFU 38%`` (``per``: ``device`` on a CPU cluster)."""
    parts = [f"global batch {terms.global_batch_size}"]
    if terms.micro_batch_size is not None:
        parts.append(f"micro-batch size {terms.micro_batch_size}")
    parts += [f"{terms.num_microbatches} microbatch{'es' if terms.num_microbatches != 1 else ''}"]
    parts.append(_degrees_words(terms))
    if terms.virtual_pipeline_parallel and terms.virtual_pipeline_parallel > 1:
        parts.append(f"VPP {terms.virtual_pipeline_parallel}")
    if terms.sequence_length:
        parts.append(f"sequence length {terms.sequence_length}")
    rate = (
        f"{_rate(terms.tokens_per_s_per_gpu)} tokens/s per {per}"
        if terms.tokens_per_s_per_gpu is not None
        else f"{_rate(terms.samples_per_s_per_gpu)} samples/s per {per}"
    )
    return f"Megatron-LM terms: {', '.join(parts)}; {rate}, MFU {terms.mfu:.0%}"
