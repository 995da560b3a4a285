"""The gathered gradient syncs (``GradSync.gathered``: top-k, 1-bit, threshold, TernGrad, QSGD, signSGD) as a DDP
communication hook, for DDP itself and for the sharded stages' buckets
(:class:`executors.parallel.grad_sync.GradReducer`).

A sparse or quantized gradient cannot be summed on the wire, so each rank's compressed bucket is all-gathered and
every rank decodes all of them — :func:`compressed_hook`, per bucket of a process group of ``n`` ranks:

1. each gradient of the bucket is compressed on its own, in fp32 (:func:`compressor_of`: the papers' per-layer
   scales, columns and top-k); the error-feedback kinds first add the gradient's residual and keep
   ``residual ← corrected − D(C(corrected))`` (:class:`executors.compressors.ErrorFeedback`, one per gradient,
   kept in :class:`CompressedSyncState` by bucket index: DDP rebuilds its buckets after its first step, so these
   kinds start after at least 2 exact steps, as torch's PowerSGD does);
2. the payloads travel as one ``uint8`` buffer (:meth:`executors.compressors.Payload.to_bytes`) of
   ``Σ payload_bytes`` (:func:`planner.costing.sync.wire_bytes.payload_bytes`, the size the cost model prices);
   threshold's payload size depends on the data, so its ranks first all-gather one int32 count per gradient and
   pad their buffers to the longest (:func:`_gather`);
3. every rank decodes the ``n`` payloads of each gradient and averages them (signSGD: the majority vote of the
   signs times the mean of the ``n`` magnitudes) into the bucket's buffer, the mean DDP's hooks return.

Deep Gradient Compression (``dgc`` ρ; Lin et al. 2018) runs the same way with its own state per gradient
(:class:`DgcGradient`): momentum correction ``u ← m·u + g``, ``v ← v + u`` (the optimizer runs without momentum:
the hook holds it, :data:`DGC_MOMENTUM` = the plan's SGD momentum), top-k of ``v`` sent, momentum factor masking
(``u`` and ``v`` zeroed where sent), and the warm-up of the sparsity: the kept share is ``max(ρ, 4^−(k+1))`` in
the ``k``-th :data:`DGC_WARMUP_STAGE_STEPS` steps after the exact warm-up (75%, 93.75%, 98.4%, 99.6% sparse, then
ρ: the paper's schedule, in steps instead of epochs). Local gradient clipping (the paper's §3.3, before ``g`` joins
the momentum; :func:`local_clip_scale`): the paper clips each worker's whole gradient to ``N^(−1/2)`` of the global
threshold ``c`` (its share if the ``N`` workers' gradients were alike); a hook sees one bucket at a time, before the
later buckets exist, so each bucket's gradients are clipped together to that threshold's share of the bucket,
``c·√(numel_bucket / numel_model)·N^(−1/2)`` (the share a bucket of equally sized elements would have of the norm),
by ``min(1, threshold / (‖g_bucket‖ + 10⁻⁶))`` (``torch.nn.utils.clip_grad_norm_``'s rule). ``c`` is
:attr:`CompressedSyncState.max_grad_norm`, given to :func:`executors.parallel.grad_sync.register_ddp_hook` or set by
the data-parallel runner from the program's ``--max-grad-norm`` at its first clip
(:meth:`executors.training.parallel_model.ParallelModel.clip_grad_norm_`), before the first compressed step (at
least two exact steps come first); without a threshold (a program that does not clip, or DGC on a sharded stage's
buckets) DGC clips nothing locally. The program still clips the global norm after the sync.

:func:`timed_codec` hands ``plan profile`` (:mod:`cost_models.profiling.codec_profiler`) one gradient's encode (its
error-feedback or DGC step included, and the payload's bytes) and one received payload's decode into the sum, as
this hook runs them, to time (signSGD's decode adds the ``±1`` signs the vote sums; threshold's gradient is scaled
so that the share of it the cost model assumes is sent).

Before ``warmup_steps`` steps (counted at each step's last bucket) the bucket is all-reduced exactly. Random
compressors (TernGrad, QSGD) draw from a generator seeded by the rank alone, so a run repeats. The
collectives are waited for inside the hook and the future it returns is complete (on gloo a future's callbacks
run on the process group's thread, where a second collective would race the main thread's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from executors.compressors import (
    QSGD,
    Compressor,
    ErrorFeedback,
    OneBit,
    Payload,
    SignSGD,
    TernGrad,
    Threshold,
    TopK,
    majority_vote,
    signs,
)
from executors.precision import SGD_MOMENTUM
from planner.costing.sync.gathered import THRESHOLD_DENSITY
from planner.plan import GradSync

RANK_SEED_STRIDE = 7919  # distinct random streams per rank
DGC_MOMENTUM = SGD_MOMENTUM  # executors.precision.make_optimizer's SGD momentum, moved into the hook
DGC_WARMUP_STAGE_STEPS = 25  # steps per stage of DGC's sparsity warm-up (the paper: one epoch per stage)
DGC_WARMUP_STAGES = 4  # kept shares 1/4, 1/16, 1/64, 1/256 before the target ratio
CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


@dataclass(kw_only=True)
class DgcGradient:
    """DGC's state of one gradient: the momentum ``u`` and the accumulated velocity ``v`` (module docstring)."""

    momentum: torch.Tensor | None = None
    velocity: torch.Tensor | None = None

    def step(self, grad: torch.Tensor, *, ratio: float, clip: float = 1.0) -> Payload:
        """One step on ``grad`` times ``clip`` (the local clipping's factor, :func:`local_clip_scale`)."""
        g = grad.detach().float() * clip
        self.momentum = g.clone() if self.momentum is None else DGC_MOMENTUM * self.momentum + g  # not a view of g
        self.velocity = self.momentum.clone() if self.velocity is None else self.velocity + self.momentum
        payload = TopK(ratio=ratio).compress(self.velocity)
        sent = payload.tensors["indices"].long()
        self.velocity.view(-1)[sent] = 0.0  # momentum factor masking: what was sent starts over
        self.momentum.view(-1)[sent] = 0.0
        return payload


def local_clip_scale(
    gradients: list[torch.Tensor], *, max_grad_norm: float | None, model_numel: int, world: int
) -> float:
    """DGC's local clipping factor of one bucket's ``gradients`` (module docstring): 1 without a threshold, else
    ``min(1, c·√(numel_bucket / model_numel)·world^(−1/2) / (‖g_bucket‖ + 10⁻⁶))``."""
    if max_grad_norm is None:
        return 1.0
    numel = sum(gradient.numel() for gradient in gradients)
    threshold = max_grad_norm * math.sqrt(numel / model_numel) / math.sqrt(world)
    norm = math.sqrt(sum(float(gradient.detach().float().pow(2).sum()) for gradient in gradients))
    return min(1.0, threshold / (norm + CLIP_EPSILON))


def dgc_ratio(grad_sync: GradSync, compressed_steps: int) -> float:
    """The share DGC keeps ``compressed_steps`` steps after its exact warm-up (the sparsity warm-up)."""
    stage = compressed_steps // DGC_WARMUP_STAGE_STEPS
    if stage >= DGC_WARMUP_STAGES:
        return grad_sync.ratio
    return max(grad_sync.ratio, 0.25 ** (stage + 1))


def compressor_of(grad_sync: GradSync) -> Compressor:
    """The compressor a gathered gradient sync runs."""
    kind = grad_sync.kind
    if kind == "topk":
        return TopK(ratio=grad_sync.ratio)
    if kind == "onebit":
        return OneBit()
    if kind == "threshold":
        return Threshold(tau=grad_sync.threshold)
    if kind == "terngrad":
        return TernGrad()
    if kind == "qsgd":
        return QSGD(levels=grad_sync.levels)
    if kind == "dgc":
        return TopK(ratio=grad_sync.ratio)
    assert kind == "signsgd", f"{kind} is not a gathered gradient sync (a bug: refused at planning time)"
    return SignSGD()


@dataclass(kw_only=True)
class CompressedSyncState:
    """A process group's compressed sync: its choice, the step count, the residuals by bucket, the random stream;
    DGC's local clipping threshold of the whole model's gradient (None: none) and the model's gradient elements."""

    process_group: Any
    grad_sync: GradSync
    max_grad_norm: float | None = None
    model_numel: int = 0
    iteration: int = 0
    feedback: dict[int, list[ErrorFeedback]] = field(default_factory=dict)
    dgc: dict[int, list[DgcGradient]] = field(default_factory=dict)
    generator: torch.Generator | None = None

    def random(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            rank = dist.get_rank(self.process_group)
            self.generator = torch.Generator(device=device).manual_seed(RANK_SEED_STRIDE * rank)
        return self.generator


def compressed_hook(state, bucket):  # DDP checks a hook's annotations against its own types: left unannotated
    """DDP communication hook of the gathered syncs (module docstring); returns a complete future of the mean."""
    buffer = bucket.buffer()
    group = state.process_group
    if state.iteration < state.grad_sync.warmup_steps:
        dist.all_reduce(buffer, group=group)
        buffer.div_(dist.get_world_size(group))
    else:
        _compressed_mean(state, index=bucket.index(), gradients=bucket.gradients())
    if bucket.is_last():
        state.iteration += 1
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _compressed_mean(state: CompressedSyncState, *, index: int, gradients: list[torch.Tensor]) -> None:
    """Compress each gradient (views into the bucket), gather every rank's, write their mean into the views."""
    compressor = compressor_of(state.grad_sync)
    payloads = _compress(state, compressor, index=index, gradients=gradients)
    everyone = _gather(payloads, state.process_group, variable=isinstance(compressor, Threshold))
    for position, gradient in enumerate(gradients):
        received = [rank_payloads[position] for rank_payloads in everyone]
        gradient.copy_(_mean(compressor, received).reshape(gradient.shape))


def _compress(
    state: CompressedSyncState, compressor: Compressor, *, index: int, gradients: list[torch.Tensor]
) -> list[Payload]:
    """Each gradient's payload, through its error feedback or DGC state where the kind keeps one."""
    kind = state.grad_sync.kind
    if kind == "dgc":
        ratio = dgc_ratio(state.grad_sync, state.iteration - state.grad_sync.warmup_steps)
        states = state.dgc.setdefault(index, [DgcGradient() for _ in gradients])
        world = dist.get_world_size(state.process_group)
        clip = local_clip_scale(
            gradients, max_grad_norm=state.max_grad_norm, model_numel=state.model_numel, world=world
        )
        return [own.step(gradient, ratio=ratio, clip=clip) for own, gradient in zip(states, gradients, strict=True)]
    generator = state.random(gradients[0].device)
    if state.grad_sync.error_feedback:
        feedback = state.feedback.setdefault(index, [ErrorFeedback(compressor=compressor) for _ in gradients])
        return [own.step(gradient, generator) for own, gradient in zip(feedback, gradients, strict=True)]
    return [compressor.compress(gradient.float(), generator) for gradient in gradients]


def _mean(compressor: Compressor, received: list[Payload]) -> torch.Tensor:
    """The average the ranks' payloads of one gradient stand for (signSGD: majority vote × mean magnitude): the sparse
    kinds scatter-add every payload into one zero-filled sum, the dense ones add each decoded payload to a running
    sum (what :mod:`planner.costing.sync.gathered` prices)."""
    if isinstance(compressor, SignSGD):
        scale = torch.stack([payload.tensors["scale"] for payload in received]).mean()
        return majority_vote([signs(payload) for payload in received]) * scale
    if isinstance(compressor, TopK | Threshold):
        total = torch.zeros(math.prod(received[0].shape), device=received[0].tensors["indices"].device)
        for payload in received:
            compressor.add_into(total, payload)
        return total.reshape(received[0].shape) / len(received)
    total = compressor.decompress(received[0])
    for payload in received[1:]:
        total += compressor.decompress(payload)
    return total / len(received)


def _gather(payloads: list[Payload], group: Any, *, variable: bool) -> list[list[Payload]]:
    """Every rank's payloads of the bucket: one all-gather of one byte buffer each; ``variable`` (threshold): the
    sent counts are gathered first and the buffers padded to the longest."""
    world = dist.get_world_size(group)
    buffer = torch.cat([payload.to_bytes() for payload in payloads])
    likes = [payloads] * world
    if variable:
        counts = torch.tensor([_sent(payload) for payload in payloads], dtype=torch.int32, device=buffer.device)
        all_counts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts, group=group)
        likes = [[_resized(p, int(n)) for p, n in zip(payloads, c.tolist(), strict=True)] for c in all_counts]
    lengths = [sum(like.wire_bytes() for like in rank_likes) for rank_likes in likes]
    padded = torch.zeros(max(1, *lengths), dtype=torch.uint8, device=buffer.device)  # gloo: no empty collectives
    padded[: buffer.numel()] = buffer
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [
        _split(data[:length], rank_likes) for data, length, rank_likes in zip(gathered, lengths, likes, strict=True)
    ]


def _sent(payload: Payload) -> int:
    return payload.tensors["indices"].numel() if "indices" in payload.tensors else 0


def _resized(payload: Payload, sent: int) -> Payload:
    """A threshold payload's layout with ``sent`` elements (another rank's count), to read its bytes."""
    empty = torch.empty(sent, dtype=torch.uint8)
    return Payload(shape=payload.shape, tensors={"indices": empty, "codes": empty}, code_bits=payload.code_bits)


def _split(data: torch.Tensor, likes: list[Payload]) -> list[Payload]:
    out, offset = [], 0
    for like in likes:
        size = like.wire_bytes()
        out.append(Payload.from_bytes(data[offset : offset + size], like=like))
        offset += size
    return out


def timed_codec(grad_sync: GradSync, grad: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(encode, decode) of ``grad`` under ``grad_sync`` for timing: ``encode()`` runs the rank's side of one gradient
    (its error-feedback or DGC state's step, or the compression, then :meth:`Payload.to_bytes`); ``decode()`` reads one
    received payload back from bytes and adds it into a flat fp32 sum, as :func:`_mean` does per payload. Threshold's
    gradient is rescaled so that :data:`planner.costing.sync.gathered.THRESHOLD_DENSITY` of it reaches ``τ``."""
    compressor = compressor_of(grad_sync)
    generator = torch.Generator(device=grad.device).manual_seed(0)
    if grad_sync.kind == "threshold":  # the share of elements at least τ that the cost model assumes
        grad = grad * (grad_sync.threshold / grad.abs().float().quantile(1 - THRESHOLD_DENSITY))
    if grad_sync.kind == "dgc":
        dgc = DgcGradient()

        def compress() -> Payload:
            return dgc.step(grad, ratio=grad_sync.ratio)
    elif grad_sync.error_feedback:
        feedback = ErrorFeedback(compressor=compressor)

        def compress() -> Payload:
            return feedback.step(grad, generator)
    else:

        def compress() -> Payload:
            return compressor.compress(grad, generator)

    like = compress()
    buffer = like.to_bytes()
    total = torch.zeros(grad.numel(), device=grad.device)

    def decode() -> None:
        payload = Payload.from_bytes(buffer, like=like)
        if isinstance(compressor, TopK | Threshold):
            compressor.add_into(total, payload)
        elif isinstance(compressor, SignSGD):
            total.add_(signs(payload))
        else:
            total.add_(compressor.decompress(payload).reshape(-1))

    return (lambda: compress().to_bytes()), decode
