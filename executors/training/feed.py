"""Which ranks read training data, how much, and how their shares become what the executor consumes.

A step's *batch* is ``(*inputs, *targets)`` at the plan's global batch ``B`` (see
:mod:`executors.session`). The ranks that read data (:func:`data_feeders`) are:

* pure data parallelism (DDP or FSDP): every replica reads its own ``B/d`` rows and trains on them —
  nothing is exchanged;
* a pipeline (even or uneven): the first stage's ranks — later stages receive activations, and the
  last stage receives the targets through the pipeline;
* one tensor-parallel stage: all its ranks; operator placements: every rank.

Outside pure data parallelism a feeding rank reads ``B/k`` rows (``k`` feeders, when ``k`` divides
``B``) and the ``k`` shares are all-gathered, in data-rank order, into the batch the executor splits
into microbatches and shards itself (:func:`assemble`). So data-parallel ranks always read different
data; the only copy is of the input batch inside one stage. When ``k`` does not divide ``B`` each
feeder reads the whole batch (``data_size`` 1): the loader must then give every feeder the same rows.

:class:`RankInfo` is what a user's ``make_dataloader(rank_info)`` receives; :func:`synthetic_batches`
is the default loader: a new batch every step from the model file's ``example_inputs`` /
``example_targets``, seeded by ``(seed, step, data_rank)``, so a resumed run draws the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from executors.session import Workload
from planner.errors import AutoplanError
from planner.ir.model_file import ModelFile, instantiate_inputs, instantiate_targets
from planner.plan import Plan
from planner.plan.schedules import Schedule


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """This rank's place in the job and the data it must read each step."""

    rank: int
    world_size: int
    device: str
    needs_data: bool  # False: this rank's executor takes no data (a later pipeline stage)
    data_rank: int  # which share of the global batch this rank reads (0 when needs_data is False)
    data_size: int  # how many distinct shares the global batch is cut into
    rows: int  # rows of each batch this rank's loader yields
    batch_size: int  # the plan's global batch
    num_inputs: int  # the batch is (*inputs, *targets): this many inputs first
    start_step: int = 0  # the first step the loader serves (after resuming from a checkpoint)
    seed: int = 0


def data_feeders(plan: Plan) -> tuple[tuple[int, ...], bool]:
    """``(ranks that read data, whether each trains on its own share without exchanging it)``."""
    if plan.schedule == Schedule.DATAFLOW:
        return tuple(range(plan.cluster.num_devices)), False
    first = tuple(plan.stages[0].devices)
    return first, plan.is_pure_data_parallel


def rank_info(plan: Plan, workload: Workload, *, rank: int, start_step: int = 0) -> RankInfo:
    feeders, _ = data_feeders(plan)
    shares = len(feeders) if plan.batch_size % len(feeders) == 0 else 1
    needs = rank in feeders
    return RankInfo(
        rank=rank,
        world_size=plan.cluster.num_devices,
        device=workload.device,
        needs_data=needs,
        data_rank=feeders.index(rank) % shares if needs else 0,
        data_size=shares,
        rows=plan.batch_size // shares,
        batch_size=plan.batch_size,
        num_inputs=workload.num_inputs,
        start_step=start_step,
        seed=workload.seed,
    )


def synthetic_batches(
    model_file: ModelFile, info: RankInfo, *, model_args: dict[str, Any]
) -> Iterator[tuple[Any, ...]]:
    """A new random batch of ``info.rows`` rows every step, from the model file's examples."""
    step = info.start_step
    while True:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_mix(info.seed, step, info.data_rank))
            inputs = instantiate_inputs(model_file, batch_size=info.rows, model_args=model_args, on_meta=False)
            targets = instantiate_targets(model_file, batch_size=info.rows, model_args=model_args, on_meta=False)
        yield tuple(x.to(info.device) if isinstance(x, torch.Tensor) else x for x in (*inputs, *targets))
        step += 1


def _mix(seed: int, step: int, data_rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + data_rank) % (2**63)


def check_batch(batch: Sequence[Any], info: RankInfo, *, expected_len: int) -> tuple[Any, ...]:
    """The loader's batch as a tuple, checked: one value per input and target, ``info.rows`` rows."""
    values = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
    if len(values) != expected_len:
        raise AutoplanError(
            f"make_dataloader yielded {len(values)} value(s); a batch is (*inputs, *targets): {expected_len} value(s)"
        )
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != info.rows:
            raise AutoplanError(
                f"make_dataloader yielded a tensor of {value.shape[0]} rows; this rank reads rank_info.rows = "
                f"{info.rows} rows per step"
            )
    return tuple(v.to(info.device) if isinstance(v, torch.Tensor) else v for v in values)


def assemble(share: tuple[Any, ...], info: RankInfo, group: dist.ProcessGroup | None) -> tuple[Any, ...]:
    """The global batch from every feeder's share (concatenated in data-rank order)."""
    if info.data_size == 1:
        return share
    whole = []
    for value in share:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == info.rows:
            pieces = [torch.empty_like(value) for _ in range(info.data_size)]
            dist.all_gather(pieces, value.contiguous(), group=group)
            whole.append(torch.cat(pieces))
        else:
            whole.append(value)
    return tuple(whole)


def global_batch_on_rank0(share: tuple[Any, ...] | None, info: RankInfo) -> tuple[Any, ...] | None:
    """Rank 0 gets the whole global batch (for the parity reference); a collective over every rank."""
    payload = (info.data_rank, _to_cpu(share)) if info.needs_data and share is not None else None
    gathered: list[Any] = [None] * info.world_size if info.rank == 0 else []
    dist.gather_object(payload, gathered if info.rank == 0 else None, dst=0)
    if info.rank != 0:
        return None
    by_rank: dict[int, tuple[Any, ...]] = {}
    for item in gathered:
        if item is not None:
            by_rank.setdefault(item[0], item[1])
    shares = [by_rank[r] for r in range(info.data_size)]
    whole = []
    for position, value in enumerate(shares[0]):
        batched = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == info.rows
        merged = torch.cat([s[position] for s in shares]) if batched else value
        whole.append(merged.to(info.device) if isinstance(merged, torch.Tensor) else merged)
    return tuple(whole)


def _to_cpu(values: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    if values is None:
        return None
    return tuple(v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in values)
