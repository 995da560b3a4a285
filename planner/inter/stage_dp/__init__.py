"""The stage DP: slice layers into pipeline stages on submeshes (Alpa §5), exact.

* :mod:`~planner.inter.stage_dp.solver` — the problem, its tables and the plan read back (:func:`solve_stages`);
* :mod:`~planner.inter.stage_dp.bound_search` — one DP run at a bound on stage times, the best-first search over bounds;
* :mod:`~planner.inter.stage_dp.device_blocks` — submeshes and the global ranks they take;
* :mod:`~planner.inter.stage_dp.boundaries` — the boundary table: activations and gradients between submeshes.

Imports :mod:`planner.costing`, :mod:`planner.ir`, :mod:`cost_models` and :mod:`planner.errors`; never the rest of
:mod:`planner.inter`.
"""
