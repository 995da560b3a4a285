"""Independent work split over forked processes (``--jobs N``): the parent takes the first share, each
forked child one other share, and the children's results come back pickled through pipes.

Used for the layer tables of one microbatch count (:meth:`planner.inter.search.LayerTables.prefetch`):
each table is an independent intra-op problem. ``fork`` is what makes this cheap — a child inherits
the captured graph, the cost setup and everything imported, so nothing is sent to it but its share's
index. Children ignore Ctrl-C (the terminal sends it to the whole process group); the parent, when
interrupted or failing, terminates them. A child that fails sends back its error's one line, which the
parent raises as an :class:`~planner.errors.InternalError` (a bug of ours: the same work succeeds or
fails alike in one process).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TypeVar

from planner.errors import InternalError

MIN_ITEMS = 8  # fewer items run in the parent alone: a fork and a pipe cost more than a few small problems
Item = TypeVar("Item")
Result = TypeVar("Result")


def _child(work: Callable[[Item], Result], share: Sequence[Item], pipe: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.simplefilter("ignore")  # the parent's share raises the same kinds of warnings
    try:
        pipe.send(("done", [work(item) for item in share]))
    except BaseException as error:
        pipe.send(("failed", f"{type(error).__name__}: {error}"))
    finally:
        pipe.close()


def fork_map(
    work: Callable[[Item], Result],
    items: Sequence[Item],
    *,
    jobs: int,
    on_done: Callable[[int], None] | None = None,
    min_items: int = MIN_ITEMS,
) -> list[Result]:
    """``[work(item) for item in items]``, over ``jobs`` processes where the platform can fork and there are
    at least ``min_items`` items.

    Items are dealt round-robin, so shares of similar items (the same layer on meshes of growing size)
    cost about the same. ``on_done(count)`` reports the parent's own progress, scaled to all items."""
    if jobs <= 1 or len(items) < max(2, min_items) or not hasattr(os, "fork"):
        results = []
        for index, item in enumerate(items):
            results.append(work(item))
            if on_done is not None:
                on_done(index + 1)
        return results
    jobs = min(jobs, len(items))
    shares = [list(range(share, len(items), jobs)) for share in range(jobs)]
    context = multiprocessing.get_context("fork")
    children = []
    try:
        for share in shares[1:]:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(work, [items[i] for i in share], send), daemon=True)
            process.start()
            send.close()
            children.append((process, receive))
        results: dict[int, Result] = {}
        for done, index in enumerate(shares[0]):
            results[index] = work(items[index])
            if on_done is not None:
                on_done(min(len(items), (done + 1) * jobs))
        for share, (_, receive) in zip(shares[1:], children, strict=True):
            for index, result in zip(share, _receive(receive), strict=True):
                results[index] = result
        return [results[index] for index in range(len(items))]
    finally:
        for process, receive in children:
            if process.is_alive():
                process.terminate()
            process.join()
            receive.close()


def _receive(pipe: Connection) -> list:
    try:
        kind, payload = pipe.recv()
    except EOFError:
        raise InternalError("a worker process died without an answer; rerun with --jobs 1 and report this") from None
    if kind == "failed":
        raise InternalError(f"a worker process failed ({payload}); rerun with --jobs 1 and report this")
    return payload
