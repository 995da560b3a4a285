"""What Delayed Gradient Averaging (``GradSync`` ``dga`` ``D``; :mod:`executors.delayed_sync`) costs a DDP stage.

Each bucket's all-reduce is the exact one (``c_k``: :func:`cost_models.communication.all_reduce_s` of its bytes),
launched when the bucket is ready; the step that launched it does not wait for it, the one ``D`` steps later does.
So ``D`` steps of work hide the communication, and a step waits only for what they did not hide. The hiding window
is priced as ``D·b`` with ``b`` the stage's last backward (the part of a step DDP's buckets overlap; the forward and
the optimizer step pass too, so the window is conservative) — :func:`delayed_segments`: every bucket's
communication is scaled by ``max(0, C − D·b) / C`` with ``C = Σ_k c_k``, so that the segments the estimate charges
(and the simulator replays) add up to what is left exposed, ``max(0, C − D·b)``. The rest of each bucket's
communication is the segment's ``hidden_s``: the simulator's timeline carries it as a background task beside the step
(:func:`planner.costing.lowered_tasks.hidden_syncs`), off the step's critical path, so the replayed step shows the whole
``C`` as ``hidden + exposed`` (:func:`sync_timeline`) while its step time stays the estimate's.

Compute per bucket of ``N`` elements of ``b`` bytes (:func:`delayed_copy_s`): the two copies the hook keeps (the
local gradient and the all-reduce's buffer: read and write ``N·b`` each) and the correction
``ĝ += avg − old`` (read three, write one pass): ``8·N·b`` bytes at the streaming bandwidth, three kernels.

Memory (:func:`delayed_state_bytes`): the last ``D + 1`` steps' local copies and sums of every bucket,
``2·(D + 1)·N·b`` bytes per device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cost_models.simulator import SimResult
from planner.costing.lowered_tasks import HIDDEN_SYNC
from planner.costing.overlap import ReadyBucket, SyncSegment
from planner.costing.setup import CostSetup

COPY_AND_CORRECT_PASSES = 8  # two copies (read, write each) and the correction (read 3, write 1)
COPY_AND_CORRECT_KERNELS = 3


def delayed_segments(segments: Sequence[SyncSegment], *, backward_s: float, delay: int) -> list[SyncSegment]:
    """``segments`` (exact all-reduces) with their communication cut to what ``delay`` backwards leave exposed, the
    rest as each segment's ``hidden_s``."""
    total = math.fsum(segment.all_reduce_s for segment in segments)
    if total <= 0:
        return list(segments)
    share = max(0.0, total - delay * backward_s) / total
    return [
        replace(segment, all_reduce_s=segment.all_reduce_s * share, hidden_s=segment.all_reduce_s * (1 - share))
        for segment in segments
    ]


def delayed_copy_s(numel: int, *, itemsize: float, setup: CostSetup) -> float:
    """The hook's copies and correction for one bucket of ``numel`` gradient elements."""
    device = setup.cluster.device
    moved = COPY_AND_CORRECT_PASSES * numel * itemsize
    return (
        moved / (device.memory_bandwidth * device.memory_efficiency)
        + COPY_AND_CORRECT_KERNELS * device.kernel_overhead_s
    )


def delayed_state_bytes(buckets: Sequence[ReadyBucket], *, delay: int, itemsize: float) -> float:
    """The queue of ``delay + 1`` steps' local copies and sums of every bucket."""
    return 2.0 * (delay + 1) * sum(bucket.numel for bucket in buckets) * itemsize


@dataclass(frozen=True, kw_only=True)
class SyncTimeline:
    """A replayed step's gradient communication: what the step waits for (``sync bucket`` tasks) and what later steps
    hide (DGA's background tasks, :func:`planner.costing.lowered_tasks.hidden_syncs`); they add up to all of it."""

    exposed_s: float
    hidden_s: float

    @property
    def comm_s(self) -> float:
        return self.exposed_s + self.hidden_s

    def describe(self, *, delay: int) -> str:
        return (
            f"communication {self.comm_s:.4g} s, hidden {self.hidden_s:.4g} s behind {delay} steps, exposed "
            f"{self.exposed_s:.4g} s"
        )


def sync_timeline(result: SimResult) -> SyncTimeline:
    """The bucket communication of a step simulated with ``record=True``, split into exposed and hidden."""
    hidden = exposed = 0.0
    for span in result.spans:
        if span.task.startswith("sync bucket"):
            seconds = span.end_s - span.start_s
            if span.task.endswith(HIDDEN_SYNC):
                hidden += seconds
            else:
                exposed += seconds
    return SyncTimeline(exposed_s=exposed, hidden_s=hidden)
