"""The second capture of :class:`planner.ir.rebatch.MicrobatchGraphs` in a forked process, beside the first.

Exporting GPT-1T takes about 5 s per capture on one core, and the planner needs two (the global
batch and the smallest microbatch). With ``jobs > 1`` the smallest size is captured by a child
process forked before the first export, and its :class:`~planner.ir.graph.OpGraph` comes back
pickled through a pipe while the parent exports the global batch: the two exports overlap.

The child inherits the model built on the meta device (``fork``: nothing is rebuilt or
re-imported), ignores warnings (the parent's capture of the same model raises the same ones) and
sends back either the graph or the one-line :class:`~planner.errors.AutoplanError` it raised. A
platform without ``fork`` captures in turn, as ``jobs=1`` does. The child ignores Ctrl-C (the terminal
sends it to the whole process group); the interrupted parent terminates it (:meth:`PendingCapture.close`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection

from planner.errors import AutoplanError, InternalError
from planner.ir.graph import OpGraph

CaptureAt = Callable[[int], OpGraph]


def _child(capture_at: CaptureAt, size: int, pipe: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops the child
    warnings.simplefilter("ignore")
    try:
        pipe.send(("graph", capture_at(size)))
    except AutoplanError as error:
        pipe.send(("error", str(error)))
    except BaseException as error:
        pipe.send(("internal", f"{type(error).__name__}: {error}"))
    finally:
        pipe.close()


class PendingCapture:
    """A capture running in a forked child; :meth:`result` waits for its graph."""

    def __init__(self, capture_at: CaptureAt, size: int) -> None:
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_child, args=(capture_at, size, send), daemon=True)
        self._process.start()
        send.close()
        self.size = size

    def result(self) -> OpGraph:
        try:
            kind, payload = self._receive.recv()
        except EOFError:
            raise InternalError(
                f"the capture at batch {self.size} in a child process died without an answer; "
                "rerun with --jobs 1 and please report this bug"
            ) from None
        finally:
            self.close()
        if kind == "error":
            raise AutoplanError(payload)
        if kind == "internal":
            raise InternalError(f"capture at batch {self.size} failed in a child process ({payload}); please report")
        return payload

    def close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._receive.close()


def start_capture(capture_at: CaptureAt, size: int, *, jobs: int) -> PendingCapture | None:
    """A child capturing ``size`` when ``jobs > 1`` and the platform can fork; else None (capture in turn)."""
    if jobs <= 1 or not hasattr(os, "fork"):
        return None
    return PendingCapture(capture_at, size)
