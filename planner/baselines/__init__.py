"""The plans autoplan is compared with, judged by the same cost model and simulator.

* :mod:`~planner.baselines.data_parallel` — pure data parallelism;
* :mod:`~planner.baselines.handwritten` — Megatron ``(t, p, d)`` grid points and uniform pipelines,
  priced by :mod:`planner.inter.pricing` (they are also ``auto``'s own candidates);
* :mod:`~planner.baselines.placement` — op placements: hash, critical path, multi-objective, m-ETF, RL.

May import: :mod:`planner.inter` and everything it may import.
"""
