"""What a gathered gradient sync (:attr:`planner.plan.GradSync.gathered`: topk, onebit, threshold, terngrad, qsgd,
signsgd, dgc) costs one bucket on one device of a group of ``n``, as :mod:`executors.compressed_sync` runs it.

The executor compresses every gradient ``i`` of the bucket (``N_i`` elements, ``b`` bytes each: the optimizer's
gradient itemsize) on its own with :mod:`executors.compressors`, concatenates the payloads into one byte buffer
and all-gathers it; every rank decompresses the ``n`` payloads of every gradient, averages them (signsgd: the
majority vote of the signs times the mean of the scales) and writes the result into the bucket. After
``warmup_steps`` exact steps — the estimate is the steady state — :func:`gathered_sync_s` charges:

* communication (:func:`gathered_comm_s`): ``all_gather(n·P)`` (:func:`cost_models.communication.all_gather_s`
  takes the gathered size) of the bucket's ``P = Σ_i payload_bytes(g, shape_i)`` bytes
  (:func:`planner.costing.sync.wire_bytes.payload_bytes`); ``threshold`` first all-gathers one int32 count per
  gradient (``all_gather(4·n·G)`` for ``G`` gradients) and then pads to the largest rank's length: its sent count
  ``s_i = ⌈THRESHOLD_DENSITY·N_i⌉`` depends on the data and is an assumption here (:data:`THRESHOLD_DENSITY`,
  :func:`sent_elements`), the same on every rank, so nothing is padded;
* compute (:func:`gathered_compute_s`), the bytes each eager torch kernel of :mod:`executors.compressors` moves at
  the device's streaming bandwidth (``memory_bandwidth · memory_efficiency``) plus ``kernel_overhead_s`` per
  kernel launch. Per gradient, with ``k_i`` its sent elements (top-k's ``⌈ρ·N_i⌉``, threshold's ``s_i``, 0 for
  the dense kinds) and the per-kind costs of :data:`KIND_COSTS` (:class:`KindCosts`; bytes per element ``e``,
  per sent element ``σ``, kernels ``κ``):

  - cast to fp32 when ``b ≠ 4``: ``(b + 4)·N`` (one kernel); error-feedback kinds (topk, onebit, threshold) add
    the residual, ``12·N`` (read both, write the sum), and after compressing decode their own payload (one
    received payload's decode, below — its unpacking a slight over-count, the local payload is not packed —
    plus a dense zero-fill ``4·N`` for the sparse kinds) and store
    ``residual = corrected − decoded``, ``12·N``;
  - encode: ``e_enc·N + σ_enc·k`` and ``κ_enc`` kernels, plus :data:`PAYLOAD_COPY_PASSES` passes of the payload
    (``Payload.to_bytes``'s concatenation and the bucket's: read and write each);
  - decode, per received payload (``n`` of them): ``e_dec·N + σ_dec·k`` and ``κ_dec`` kernels, plus one read of
    the payload out of the gathered buffer; the dense kinds then accumulate it into the sum, ``e_sum·N`` (read
    the sum and the decoded payload, write the sum), while the sparse kinds scatter-add straight into one
    zero-filled sum (their ``σ_dec``); this term scales with ``n``, the price of summing after the gather;
  - finish, once: ``(e_fin + b)·N``: the zero-fill of the sparse kinds' sum, the division by ``n`` (signsgd: the
    vote's sign and the mean scale) and the copy into the bucket's dtype.

  The per-kind bytes (:data:`KIND_COSTS`) follow the kernels of :mod:`executors.compressors`, counting fp32 as 4
  bytes an element, uint8 and bool codes as 1, int64 indices as 8, and packing unsigned codes
  (:func:`executors.compressors.pack_codes`: pad, shift, sum) as 5 bytes an element, unpacking (shift, mask,
  bool or float cast) as 3:

  - ``topk``: encode ``|x|`` (8), the selection reading the magnitudes :data:`TOPK_SELECT_READS` times, then per
    sent element the gather of its value (index 8, value 4, write 4) and the int32 cast of its index (12): 28;
    decode per payload per sent element: the clones of values and indices out of the buffer (16), the int64 cast
    (12) and the scatter-add (index 8, value 4, read and write the sum 8): 48;
  - ``onebit``: encode ``x ≥ 0`` (5), the column counts and sums (three column reductions, 1 + 4 + 4), the
    masked ``where`` (9), the codes' uint8 cast (2) and the packing (5): 30; decode unpack (3), ``bool`` (2), the
    ``where`` of the two column values (5): 10;
  - ``threshold``: encode ``|x|`` (8), ``|x| ≥ τ`` (5) and ``nonzero`` over the mask (2); per sent element the
    gather (16), its sign (5), the uint8 cast (2), the int32 index cast (12) and the packing (5): 40; decode per
    sent element: unpack (3), the float signs (5 + 8 + 8), ``·τ`` (8), the int64 index cast (12), the scatter-add
    (16): 60;
  - ``terngrad``: encode ``|x|`` twice (16), the max (4), the probabilities (8), the uniform draws (4), the
    Bernoulli compare (9), ``sign`` (8), its product with the draws (9), ``+ 1`` (8), the uint8 cast (5) and the
    packing (5): 76; decode unpack (3), the float cast (5), ``− 1`` (8), ``·s`` (8): 24;
  - ``qsgd``: encode the norm (4), ``|x| / ‖x‖ · s`` (8 + 8 + 8), ``floor`` (8), the draws (4), ``scaled − lower``
    (12), the compare (9), ``lower + draw`` (9), ``sign`` (8), ``sign · level`` (12), ``+ s`` (8), the uint8 cast
    (5) and the packing (5): 108; decode unpack (3), the float cast (5), ``− s`` (8), ``· ‖x‖`` (8), ``/ s`` (8): 32;
  - ``signsgd``: encode ``x ≥ 0`` (5), the uint8 cast (2), ``|x|`` (8), its mean (4), the packing (5): 24;
    decode per payload unpack (3) and the ``±1`` signs (5 + 8 + 8): 24, stacked for the vote (8) and summed
    (read 4): ``e_sum`` 12; finish: the sum's write (4), its sign (8), the scale (8) and the copy (4): 24.

  - ``dgc`` ρ: top-k's costs (its steady state, after the sparsity warm-up), without the error-feedback residual
    (DGC keeps no residual but its velocity), plus the momentum correction per element, ``u ← m·u + g`` (the
    product: read 4, write 4; the sum: read 8, write 4) and ``v ← v + u`` (read 8, write 4): 32 bytes, three
    kernels (:data:`DGC_MOMENTUM_BYTES`), and the masking of the sent elements in ``u`` and ``v`` (index 8, write
    4, twice: 24 a sent element, two kernels).

  Kernel counts (``κ``) count the same ops, the selection as :data:`TOPK_SELECT_KERNELS` and the packing and
  unpacking as 4 and 3, plus one each for the payload's concatenation, the cast, the residual's add and store,
  the sparse kinds' zero-fill and each payload's accumulation (:func:`gradient_compute`). A bucket synced over
  several mesh axes pays all of this once per axis (as :func:`planner.costing.compression.bucket_sync_s` loops
  its groups).

Memory (:func:`gathered_state_bytes`): the error-feedback kinds keep one fp32 residual per gradient, ``4·N`` per
bucket, for the whole run; DGC its momentum and velocity, ``8·N``. The gathered buffers (``n·P`` bytes) and the
decoded sums of one bucket are transients of its sync; no memory term holds a sync's transients, so they are not
counted.

:func:`pricing_caveat` says what the estimate assumes that the data decides (threshold's density), for the plan's
notes. Every constant below marked *assumption* is ours, not a measurement.

Measured instead (:func:`measured_compute_s`): when the setup holds ``plan profile``'s fit of the sync
(:attr:`planner.costing.setup.CostSetup.codec_fits`, by label: ``--cost-model profiled`` on this machine's CPU;
:mod:`cost_models.profiling.codec_profiler`), a gradient of ``N`` elements costs ``encode(N) + n·decode(N)`` — the
fitted lines ``a + b·N`` of the hook's own encode (error feedback or DGC's momentum included, the payload's bytes)
and of one received payload's decode into the sum — times the device's ``shared_slowdown`` (as measured operators are),
plus the cast and the finish above at the streaming bandwidth (not timed). Syncs without a fit keep the bytes model;
:func:`compute_source` says which for the plan's notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cost_models.cluster import Link
from cost_models.communication import all_gather_s
from cost_models.memory import optimizer_bytes
from planner.costing.overlap import GradEntry, ReadyBucket
from planner.costing.setup import CostSetup
from planner.costing.sync.wire_bytes import INDEX_BYTES, VALUE_BYTES, payload_bytes, topk_count
from planner.plan import GradSync

if TYPE_CHECKING:
    from cost_models.profiling.codec_profiler import CodecFit

# assumption: threshold sends 1% of a gradient's elements (Strom's τ is tuned for a small share; the executor
# counts the real number, which the data decides)
THRESHOLD_DENSITY = 0.01
# assumption: torch.topk's radix selection reads the magnitudes once per 8-bit digit of a 32-bit key (4) and once
# more to gather the elements at or above the k-th; as many kernels
TOPK_SELECT_READS = 5
TOPK_SELECT_KERNELS = 5
PAYLOAD_COPY_PASSES = 4  # Payload.to_bytes' torch.cat and the bucket's: read and write the payload bytes twice
ERROR_FEEDBACK_ADD_BYTES = 12  # corrected = gradient + residual: read 4 + 4, write 4 per element
ERROR_FEEDBACK_STORE_BYTES = 12  # residual = corrected − decoded: read 4 + 4, write 4 per element
ZERO_FILL_BYTES = VALUE_BYTES  # the sparse kinds' dense zeros before a scatter


DENSE_SUM_BYTES = 12  # sum += decoded payload: read 4 + 4, write 4 per element
DENSE_FINISH_BYTES = 8 + 4  # the division by n (read, write) and the read of the copy into the bucket


@dataclass(frozen=True, kw_only=True)
class KindCosts:
    """Bytes and kernels of one kind's encode and decode (module docstring): per element, per sent element; the
    defaults are the dense kinds' accumulation and finish."""

    encode_per_element: float
    encode_kernels: int
    decode_per_element: float  # per received payload
    decode_kernels: int  # per received payload
    encode_per_sent: float = 0.0
    decode_per_sent: float = 0.0  # per received payload
    sum_per_element: float = DENSE_SUM_BYTES  # per received payload: accumulate it into the sum
    finish_per_element: float = DENSE_FINISH_BYTES  # once, besides writing the result in the gradient's dtype
    finish_kernels: int = 2


SPARSE_FINISH_BYTES = ZERO_FILL_BYTES + DENSE_FINISH_BYTES  # the sum zero-filled before the scatter-adds


def sparse_costs(*, encode: tuple[float, float, int], decode: tuple[float, int]) -> KindCosts:
    """A sparse kind's costs: encode (bytes per element, per sent element, kernels), decode (bytes per sent
    element, kernels), scatter-added into one zero-filled sum (no dense pass per payload)."""
    (per_element, per_sent, kernels), (decode_per_sent, decode_kernels) = encode, decode
    return KindCosts(
        encode_per_element=per_element,
        encode_per_sent=per_sent,
        encode_kernels=kernels,
        decode_per_element=0,
        decode_per_sent=decode_per_sent,
        decode_kernels=decode_kernels,
        sum_per_element=0,
        finish_per_element=SPARSE_FINISH_BYTES,
        finish_kernels=3,
    )


# derived, not measured: the eager kernels of executors.compressors (module docstring); assumption: the executor
# scatter-adds the sparse kinds' payloads into one sum and decodes then accumulates the dense kinds' one by one
KIND_COSTS: dict[str, KindCosts] = {
    "topk": sparse_costs(encode=(8 + 4 * TOPK_SELECT_READS, 28, 3 + TOPK_SELECT_KERNELS), decode=(48, 4)),
    "threshold": sparse_costs(encode=(15, 40, 11), decode=(60, 9)),
    "onebit": KindCosts(encode_per_element=30, encode_kernels=19, decode_per_element=10, decode_kernels=7),
    "terngrad": KindCosts(encode_per_element=76, encode_kernels=15, decode_per_element=24, decode_kernels=7),
    "qsgd": KindCosts(encode_per_element=108, encode_kernels=18, decode_per_element=32, decode_kernels=8),
    "signsgd": KindCosts(
        encode_per_element=24,
        encode_kernels=8,
        decode_per_element=24,
        decode_kernels=7,
        finish_per_element=4 + 8 + 8 + 4,  # the vote's write, its sign, the mean scale, the copy's read
        finish_kernels=4,
    ),
}
DGC_MOMENTUM_BYTES = 32  # u ← m·u + g (mul: 8, add: 12) and v ← v + u (12), per element
DGC_MOMENTUM_KERNELS = 3
DGC_MASK_BYTES_PER_SENT = 24  # u and v zeroed where sent: index 8 + write 4, twice
KIND_COSTS["dgc"] = sparse_costs(
    encode=(8 + 4 * TOPK_SELECT_READS + DGC_MOMENTUM_BYTES, 28 + DGC_MASK_BYTES_PER_SENT, 3 + TOPK_SELECT_KERNELS + 5),
    decode=(48, 4),
)
SPARSE_KINDS = frozenset({"topk", "threshold", "dgc"})


def sent_elements(grad_sync: GradSync, numel: int) -> int:
    """Elements a sparse kind sends of a gradient of ``numel`` (threshold: at :data:`THRESHOLD_DENSITY`)."""
    if grad_sync.kind in ("topk", "dgc"):
        return topk_count(grad_sync.ratio, numel)
    if grad_sync.kind == "threshold":
        return math.ceil(THRESHOLD_DENSITY * numel)
    return 0


def bucket_payload_bytes(entries: Sequence[GradEntry], grad_sync: GradSync) -> int:
    """``P``: the bytes one rank sends for the bucket (its gradients' payloads, concatenated)."""
    return sum(payload_bytes(grad_sync, entry.shape, sent=sent_elements(grad_sync, entry.numel)) for entry in entries)


def gathered_comm_s(entries: Sequence[GradEntry], grad_sync: GradSync, *, devices: int, link: Link) -> float:
    """The bucket's all-gather over ``devices`` (threshold: its counts' all-gather first)."""
    comm = all_gather_s(devices * bucket_payload_bytes(entries, grad_sync), num_devices=devices, link=link)
    if grad_sync.kind == "threshold":
        comm += all_gather_s(devices * INDEX_BYTES * len(entries), num_devices=devices, link=link)
    return comm


def gradient_compute(entry: GradEntry, grad_sync: GradSync, *, devices: int, itemsize: float) -> tuple[float, int]:
    """(bytes moved, kernels) to encode one gradient, decode the ``devices`` payloads and write the average."""
    costs, numel = KIND_COSTS[grad_sync.kind], entry.numel
    sent = sent_elements(grad_sync, numel)
    payload = payload_bytes(grad_sync, entry.shape, sent=sent)
    decode_bytes = costs.decode_per_element * numel + costs.decode_per_sent * sent
    moved = costs.encode_per_element * numel + costs.encode_per_sent * sent + PAYLOAD_COPY_PASSES * payload
    kernels = costs.encode_kernels + 1
    if itemsize != VALUE_BYTES:
        moved, kernels = moved + (itemsize + VALUE_BYTES) * numel, kernels + 1
    if grad_sync.error_feedback and grad_sync.kind != "dgc":  # DGC keeps its velocity instead (in its encode)
        zero_fill = ZERO_FILL_BYTES * numel if grad_sync.kind in SPARSE_KINDS else 0
        moved += (ERROR_FEEDBACK_ADD_BYTES + ERROR_FEEDBACK_STORE_BYTES) * numel + decode_bytes + zero_fill
        kernels += 2 + costs.decode_kernels + (1 if zero_fill else 0)
    moved += devices * (decode_bytes + payload + costs.sum_per_element * numel)
    kernels += devices * (costs.decode_kernels + (1 if costs.sum_per_element else 0))
    moved += (costs.finish_per_element + itemsize) * numel
    return moved, kernels + costs.finish_kernels


def gathered_compute_s(entries: Sequence[GradEntry], grad_sync: GradSync, *, devices: int, setup: CostSetup) -> float:
    """Encode, decode and average the bucket on one device of ``devices`` (module docstring): from ``plan profile``'s
    fit of ``grad_sync`` when the setup has one (:func:`measured_compute_s`), else from the bytes moved."""
    fit = setup.codec_fits.get(grad_sync.label)
    if fit is not None:
        return measured_compute_s(entries, fit, devices=devices, setup=setup)
    device = setup.cluster.device
    itemsize = optimizer_bytes(setup.optimizer).grads
    moved = kernels = 0.0
    for entry in entries:
        entry_bytes, entry_kernels = gradient_compute(entry, grad_sync, devices=devices, itemsize=itemsize)
        moved, kernels = moved + entry_bytes, kernels + entry_kernels
    return moved / (device.memory_bandwidth * device.memory_efficiency) + kernels * device.kernel_overhead_s


def measured_compute_s(entries: Sequence[GradEntry], fit: CodecFit, *, devices: int, setup: CostSetup) -> float:
    """``Σ_i shared_slowdown·(encode(N_i) + n·decode(N_i))`` from the measured fit, plus what it did not time at the
    streaming bandwidth: the cast to fp32 when ``b ≠ 4`` and the finish (the division by ``n`` and the copy into the
    bucket, ``DENSE_FINISH_BYTES + b`` an element, two kernels)."""
    device = setup.cluster.device
    itemsize = optimizer_bytes(setup.optimizer).grads
    measured = math.fsum(fit.encode(entry.numel) + devices * fit.decode(entry.numel) for entry in entries)
    cast = itemsize + VALUE_BYTES if itemsize != VALUE_BYTES else 0
    moved = sum((cast + DENSE_FINISH_BYTES + itemsize) * entry.numel for entry in entries)
    kernels = len(entries) * (2 + (1 if cast else 0))
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    return device.shared_slowdown * measured + moved / bandwidth + kernels * device.kernel_overhead_s


def compute_source(grad_sync: GradSync, setup: CostSetup) -> str | None:
    """How the plan's notes say the encode and decode of a gathered sync were priced (None: not a gathered kind)."""
    if not grad_sync.gathered:
        return None
    if grad_sync.label in setup.codec_fits:
        return "its encode and decode priced from the times plan profile measured on this machine"
    return "its encode and decode priced from the bytes they move at the device's streaming bandwidth (not measured)"


def gathered_sync_s(
    entries: Sequence[GradEntry], grad_sync: GradSync, *, devices: int, link: Link, setup: CostSetup
) -> tuple[float, float]:
    """(communication s, compute s) of one bucket's gathered sync over one group of ``devices``."""
    return (
        gathered_comm_s(entries, grad_sync, devices=devices, link=link),
        gathered_compute_s(entries, grad_sync, devices=devices, setup=setup),
    )


def gathered_state_bytes(buckets: Sequence[ReadyBucket], grad_sync: GradSync) -> float:
    """The error-feedback kinds' fp32 residuals, ``4·N`` per bucket, and DGC's momentum and velocity, ``8·N``: kept
    for the run (0 for the others)."""
    if not grad_sync.error_feedback:
        return 0.0
    per_element = 2 * VALUE_BYTES if grad_sync.kind == "dgc" else VALUE_BYTES
    return float(sum(bucket.numel for bucket in buckets) * per_element)


def pricing_caveat(grad_sync: GradSync) -> str | None:
    """What the estimate of ``grad_sync`` assumes that the data decides, for the plan's notes (None: nothing)."""
    if grad_sync.kind == "threshold":
        return (
            f"priced as if {THRESHOLD_DENSITY:.0%} of each gradient's elements reach the threshold (the data "
            "decides how many are sent)"
        )
    return None
