"""What every planning method reads: the model's graphs, the cost setup, the options and a progress callback.

:class:`PlanningInput` is the one argument of :func:`planner.auto.auto_plan` and of the hand-written methods
(:mod:`planner.baselines.handwritten_plan`); :attr:`planner.preparation.Prepared.inputs` builds it from a prepared
model, so a method reads the full graph as ``inputs.full_graph`` (the capture at the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.costing.setup import CostSetup
from planner.inter.search import Progress
from planner.ir.graph import OpGraph
from planner.ir.rebatch import MicrobatchGraphs
from planner.options import PlanOptions


@dataclass(frozen=True, kw_only=True)
class PlanningInput:
    """A captured model, its cost setup and the options of the run."""

    graphs: MicrobatchGraphs  # the graph at every microbatch size the search tries
    setup: CostSetup  # cluster, compute model, optimizer, memory budget, runtime
    options: PlanOptions  # checked once, read by every method
    progress: Progress | None = None  # called as (what, done, total) during long work

    @property
    def full_graph(self) -> OpGraph:
        """The graph at the whole batch."""
        return self.graphs.full
