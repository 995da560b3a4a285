"""The order each pipeline rank runs its actions in, for every schedule the executors run.

A pipeline of ``P`` ranks (groups of devices; a stage's mesh is one group) and ``v`` *virtual stages*
per rank has ``S = P·v`` stages; stage ``k`` lives on rank ``k mod P`` (torch's loop placement). Per
microbatch ``i`` a stage runs a forward ``F``, and either one backward ``B`` or, under zero bubble,
the backward for its inputs ``I`` (what the previous stage waits for) and later the backward for its
weights ``W`` (which fills what would have been the bubble). :func:`rank_actions` gives rank ``r``'s
actions in the order the executor's schedule class runs them:

* ``gpipe`` (``ScheduleGPipe``, ``v = 1``): every forward, then every backward;
* ``1f1b`` (``Schedule1F1B``, ``v = 1``): ``min(P − r − 1, m)`` warm-up forwards, then one forward
  one backward, then the remaining backwards (:func:`one_f_one_b`);
* ``interleaved`` (``ScheduleInterleaved1F1B``, Narayanan et al. 2021 §2.2, ``v ≥ 2``) and
  ``zero-bubble`` (``ScheduleInterleavedZeroBubble``, Qi et al. 2024's ZB1P, ``v ≥ 1``):
  :func:`interleaved_actions`, a transcription of torch 2.13's ``_get_warmup_ops`` and
  ``_get_1f1b_rank_ops`` without the empty slots (the runtime runs the actions in order and waits on
  its receives; the empty slots only pad torch's timeline picture). Microbatches go in rounds of
  ``m / max(1, m // P)``; a rank runs ``(v − 1)·round + f·(P − 1 − r)`` warm-up forwards (``f = 2``,
  or 1 under zero bubble, capped at ``v·m``), then alternates forward and backward, then drains;
  forwards walk the rank's stages in round order, backwards in reverse. Under zero bubble each
  backward is an ``I``, and after the first ``r`` steady-state steps each step also runs the oldest
  pending ``W``; the rest run at the end.

``tests/test_schedules.py`` checks every order against the ``pipeline_order`` torch's own schedule
classes compute. :func:`check_schedule` refuses what torch's classes refuse.

A zero-bubble schedule splits each backward (torch's ``stage_backward_input``, then ``stage_backward_weight``): on
every stage but the first, the weight gradients are computed from where the parameters' paths meet the paths of
the stage inputs that need a gradient. A parameter of such a stage whose path meets none of them (an embedding
looked up from the model's integer inputs, sent on unchanged) gets no gradient at all (a known gap, noted in
torch's ``backward_weight_one_chunk``). :func:`split_backward_refusal` finds that at planning time, so such a
pipeline is never offered under zero bubble (:mod:`planner.inter.schedule_variants`), and the executor refuses a
plan that has it before it runs (``executors.parallel.pipeline.PipelineRunner``).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from planner.errors import AutoplanError
from planner.ir.graph import OpGraph, ValueKind

if TYPE_CHECKING:
    from planner.plan.stage import Stage


class Schedule(enum.StrEnum):
    """A plan's schedule (``Plan.schedule``); each member *is* its string, so JSON and printed text read as before.

    ``none``: one stage; ``dataflow``: op placements, each op runs when its inputs arrive; ``interleaved`` and
    ``zero-bubble`` may hold several stages per pipeline rank (stage k on the devices of stage k mod P).
    """

    NONE = "none"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero-bubble"
    DATAFLOW = "dataflow"


Action = tuple[int, str, int]  # (stage, "F" | "B" | "I" | "W", microbatch)
# the schedules that may hold several stages per rank
MULTI_STAGE_SCHEDULES = (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE)


def in_flight_microbatches(schedule: str, *, num_stages: int, stage: int, m: int) -> int:
    """The microbatches stage ``stage`` of ``num_stages`` holds at its peak, as the estimate prices its memory: all
    ``m`` under GPipe (and dataflow placements), ``min(S − s, m)`` under 1F1B and the schedules priced like it."""
    return m if schedule in (Schedule.GPIPE, Schedule.DATAFLOW) else max(1, min(num_stages - stage, m))


def rounds(num_microbatches: int, num_ranks: int) -> int:
    """How many rounds torch's interleaved schedules cut the microbatches into."""
    return max(1, num_microbatches // num_ranks)


def check_schedule(schedule: str, *, num_ranks: int, virtual_stages: int, num_microbatches: int) -> None:
    """Raise :class:`AutoplanError` naming what to change when torch's schedule class would refuse this."""
    m = num_microbatches
    if schedule == Schedule.INTERLEAVED and virtual_stages < 2:
        raise AutoplanError("schedule interleaved needs at least 2 virtual stages per rank (stages = ranks × v)")
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.NONE) and virtual_stages != 1:
        raise AutoplanError(f"schedule {schedule} runs one stage per rank; use interleaved or zero-bubble for more")
    if schedule in MULTI_STAGE_SCHEDULES and m % rounds(m, num_ranks):
        raise AutoplanError(
            f"schedule {schedule} with {num_ranks} pipeline ranks needs the {m} microbatches to split into "
            f"{rounds(m, num_ranks)} equal rounds (torch's interleaved schedules): pick a multiple of it"
        )


def rank_actions(
    schedule: str, *, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> list[Action]:
    """Rank ``rank``'s actions, in the order it runs them (see the module docstring)."""
    assert 0 <= rank < num_ranks, "a rank of the pipeline"
    if schedule in MULTI_STAGE_SCHEDULES:
        return interleaved_actions(
            num_ranks=num_ranks,
            virtual_stages=virtual_stages,
            num_microbatches=num_microbatches,
            rank=rank,
            zero_bubble=schedule == Schedule.ZERO_BUBBLE,
        )
    assert virtual_stages == 1, f"{schedule} runs one stage per rank"
    m = num_microbatches
    if schedule == Schedule.GPIPE:
        return [(rank, "F", i) for i in range(m)] + [(rank, "B", i) for i in range(m)]
    return [(rank, kind, i) for kind, i in one_f_one_b(num_stages=num_ranks, stage=rank, num_microbatches=m)]


def one_f_one_b(*, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """1F1B's ``("F", i)`` / ``("B", i)`` for one stage of ``num_stages``."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def interleaved_actions(
    *, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int, zero_bubble: bool
) -> list[Action]:
    """torch's ``_get_1f1b_rank_ops`` for interleaved 1F1B or ZB1P, the empty slots left out."""
    p, v, m = num_ranks, virtual_stages, num_microbatches
    per_round = m // rounds(m, p)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)

    def forward_stage(step: int) -> int:
        return (step // per_round) % v * p + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    counters: dict[tuple[str, int], int] = defaultdict(int)

    def next_action(kind: str, stage_of: Callable[[int], int], step: int) -> Action:
        stage = stage_of(step)
        counters[kind, stage] += 1
        return (stage, kind, counters[kind, stage] - 1)

    actions: list[Action] = []
    backward_steps: list[int] = []  # the steps whose backward ran, in order: their W follow in that order
    weights_done = 0
    for step in range(m * v + warmup):  # warm-up, steady state (F then B), cool-down (B only)
        if step < m * v:
            actions.append(next_action("F", forward_stage, step))
        if step < warmup:
            continue
        actions.append(next_action("I" if zero_bubble else "B", backward_stage, step))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            actions.append(next_action("W", backward_stage, backward_steps[weights_done]))
            weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        actions.append(next_action("W", backward_stage, backward_steps[weights_done]))
        weights_done += 1
    return actions


def split_backward_refusal(graph: OpGraph, stages: Sequence[Stage]) -> str | None:
    """Why a zero-bubble schedule would lose a parameter's gradient on ``stages`` (module docstring), or None."""
    readers = graph.consumers()
    for index, stage in enumerate(stages[1:], start=1):
        lost = unreached_params(graph, stage.nodes, readers=readers)
        if lost:
            return (
                f"under zero bubble stage {index} would get no gradient for {lost[0]} ({len(lost)} parameter(s)): "
                "torch's split backward computes a stage's weight gradients from its inputs' gradients, and no input "
                "of the stage that needs a gradient reaches it; re-plan with --schedule gpipe, 1f1b or interleaved"
            )
    return None


def unreached_params(
    graph: OpGraph, names: Sequence[str], *, readers: Mapping[str, Sequence[str]] | None = None
) -> list[str]:
    """The parameters read by the nodes ``names`` whose paths to the stage's outputs meet no value that depends on
    a floating value computed outside the stage (a stage input that needs a gradient); ``readers``: the graph's
    :meth:`~planner.ir.graph.OpGraph.consumers`, where the caller has them."""
    mine = set(names)
    order = [node for node in graph.nodes if node.name in mine]
    reached: set[str] = set()
    for node in order:
        if any(
            value in reached
            or (
                graph.value_kind(value) == ValueKind.NODE and value not in mine and graph.node(value).output.is_floating
            )
            for value in node.inputs
        ):
            reached.add(node.name)
    readers = graph.consumers() if readers is None else readers
    meets: set[str] = set()
    for node in reversed(order):
        if node.name in reached or any(reader in meets for reader in readers.get(node.name, ())):
            meets.add(node.name)
    return [
        value
        for node in order
        if node.name not in meets
        for value in dict.fromkeys(node.inputs)
        if graph.value_kind(value) == ValueKind.PARAM
    ]
