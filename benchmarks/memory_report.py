"""The text and tables of ``benchmarks/memory.py``'s results page.

A row's error is ``estimate / measured − 1``: the plan's estimate against the fullest rank's measured
peak; per rank, the simulator's per-device peak against that rank's. A rank's measured peak is the
largest of its attempts (they agree unless the page says otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MIB = 2**20
WITHIN = 0.15  # targets: every row within ±15%...
UNDER = 0.10  # ...and none more than 10% under

MEASURED = (
    "*Measured*: a rank's peak over one profiled SGD step after 2 warm-up steps "
    "(`executors/measure/memory_peak.py`): the CPU allocator's count of live bytes at its most during the step, "
    "counted from when the rank starts building its runner, plus the model's own parameters the runner trains in "
    "place — what `torch.cuda.max_memory_allocated` reports on a GPU, less the rank's unsharded copy of the model "
    "(built before its shards are taken), module buffers read in place and the input batch. Parts: *held* (the "
    "model's parameters trained in place), *runner* (what building the runner and the warm-up steps left "
    "allocated: shards, DDP's buckets, FSDP's buffers), *step* (the most the step added: gradients, activations, "
    "transients, communication buffers). *Estimate*: `Plan.estimate.memory_per_device_bytes` (no reserve in it), "
    "against the fullest rank; *simulated*: the discrete-event replay's per-device peak, against each rank."
)


def describe(which: str, cases: Mapping, *, minutes: float) -> str:
    listed = "; ".join(
        f"`{name}`: examples/{case.model} "
        + " ".join(f"{k}={v}" for k, v in case.args.items())
        + f", batch {case.batch}"
        for name, case in cases.items()
    )
    held = "held out: scored once the memory model was final" if which == "scored" else "the set changes are tried on"
    return (
        f"**{which.capitalize()} set** ({held}): {listed}. Families: `dp` `--method data-parallel` as planned (DDP, or "
        f"FSDP at the ZeRO level it finds fastest), `fsdp` data parallel "
        f"`--zero 3`, `tp` megatron `--degrees W,1,1`, `pipe` megatron `--degrees 1,2,W/2 --schedule 1f1b "
        f"--microbatches 4`, `auto`, `hash` (op placement, on a few cases); cluster `local-cpu --devices-per-node W`, "
        f"optimizer sgd, roofline costs.\n\n{MEASURED}\n\nWall time of the run: {minutes:.0f} min."
    )


def peaks(row: Mapping) -> list[int]:
    """Each rank's measured peak: the largest over the attempts."""
    return [max(values) for values in zip(*row["measured_bytes"], strict=True)]


def error(row: Mapping) -> float:
    return row["estimate_bytes"] / max(peaks(row)) - 1


def summary_table(rows: Sequence[Mapping]) -> str:
    measured = [row for row in rows if "measured_bytes" in row and "failed" not in row]
    lines = [
        "| world | plans | refused / failed to run | mean abs error | within ±15% | more than 10% under | worst "
        "| attempts agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world in sorted({row["world"] for row in rows}):
        mine = [row for row in measured if row["world"] == world]
        lines.append(_summary_line(str(world), mine, refused=_not_run([row for row in rows if row["world"] == world])))
    lines.append(_summary_line("all", measured, refused=_not_run(rows)))
    return "\n".join(lines)


def _not_run(rows: Sequence[Mapping]) -> str:
    return f"{sum(1 for row in rows if 'refused' in row)} / {sum(1 for row in rows if 'failed' in row)}"


def _summary_line(label: str, rows: Sequence[Mapping], *, refused: str) -> str:
    if not rows:
        return f"| {label} | 0 | {refused} | - | - | - | - | - |"
    errors = [error(row) for row in rows]
    worst = max(range(len(rows)), key=lambda i: abs(errors[i]))
    within = sum(1 for e in errors if abs(e) <= WITHIN)
    under = sum(1 for e in errors if e < -UNDER)
    agree = sum(1 for row in rows if _agree(row))
    return (
        f"| {label} | {len(rows)} | {refused} | {sum(abs(e) for e in errors) / len(errors):.1%} | {within}/{len(rows)} "
        f"| {under}/{len(rows)} | {_key(rows[worst])} {errors[worst]:+.0%} | {agree}/{len(rows)} |"
    )


def _agree(row: Mapping) -> bool:
    return all(attempt == row["measured_bytes"][0] for attempt in row["measured_bytes"])


def _key(row: Mapping) -> str:
    return f"{row['case']}-{row['family']}@{row['world']}"


def _mib(values: Sequence[float]) -> str:
    return ", ".join(f"{v / MIB:.2f}" for v in values)


def rows_table(rows: Sequence[Mapping]) -> str:
    lines = [
        "| plan | stages | measured MiB per rank | held / runner / step MiB (fullest rank) | estimate MiB | error "
        "| simulated MiB per rank | simulated error per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "refused" in row or "failed" in row:
            why = f"refused: {row['refused']}" if "refused" in row else f"failed to run: {row['failed']}"
            lines.append(f"| {_key(row)} | {why} | | | | | | |")
            continue
        measured = peaks(row)
        fullest = max(range(len(measured)), key=lambda r: measured[r])
        part = row["parts"][0][fullest]
        split = f"{part['held'] / MIB:.2f} / {part['runner'] / MIB:.2f} / {part['step'] / MIB:.2f}"
        simulated = row["simulated_bytes"]
        per_rank = ", ".join(f"{s / m - 1:+.0%}" for s, m in zip(simulated, measured, strict=False) if m)
        differ = "" if _agree(row) else " (attempts: " + "; ".join(_mib(a) for a in row["measured_bytes"]) + ")"
        lines.append(
            f"| {_key(row)} | {row['stages']} ({row['method']}, m={row['microbatches']}) | {_mib(measured)}{differ} | "
            f"{split} | {row['estimate_bytes'] / MIB:.2f} | {error(row):+.1%} | {_mib(simulated)} | {per_rank} |"
        )
    return "\n".join(lines)
