"""Device placement: every operator on one device (the classic baselines).

* :mod:`~planner.baselines.placement.problem` — the placement problem as plain numbers;
* :mod:`~planner.baselines.placement.hash_placement`, :mod:`~.critical_path`, :mod:`~.multi_objective`,
  :mod:`~.m_etf` — the heuristics; :mod:`~.rl` — REINFORCE over groups of operators;
* :mod:`~planner.baselines.placement.dataflow` — an assignment as a task graph, simulated;
* :mod:`~planner.baselines.placement.methods` — a method's placement as plan stages with its estimate.

May import: what :mod:`planner.baselines` may import.
"""
