"""What else ran on the machine while a plan was timed: the CPU shares of the VM's host and of other processes.

Around a plan's timed steps rank 0 reads the CPU tick counters of /proc/stat (:func:`cpu_ticks`: ``steal`` is the
time the VM's host took; busy = total − idle − iowait − steal) and every rank its own CPU time
(:func:`own_cpu_ticks`, ``getrusage``, all threads); :func:`machine_shares` turns them into the share of all
CPU ticks the host stole and the share other processes used. ``executors.measure.step_timing`` and
``executors.measure.measure_plan`` report them so a caller can keep the least disturbed of several runs.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path


def cpu_ticks() -> tuple[int, int, int]:
    """(stolen, busy, total) CPU ticks of all cores since boot, from /proc/stat (zeros off Linux)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return steal, total - idle - steal, total


def own_cpu_ticks() -> float:
    """CPU ticks this process used so far, all threads (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * os.sysconf("SC_CLK_TCK")


def machine_shares(before: tuple[int, int, int], after: tuple[int, int, int], *, ours_ticks: float) -> dict[str, float]:
    """``steal`` and ``foreign`` shares of all CPU ticks between two :func:`cpu_ticks` readings, given
    the ticks our own processes used meanwhile."""
    total = max(after[2] - before[2], 1)
    busy = after[1] - before[1]
    return {"steal": (after[0] - before[0]) / total, "foreign": max(0.0, (busy - ours_ticks) / total)}
