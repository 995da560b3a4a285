"""Intra-operator parallelism: one stage's per-operator sharding on one logical mesh, by ILP (Alpa §4).

* :mod:`~planner.intra.stage_problem` — the stage problem: every node's strategies and their costs;
* :mod:`~planner.intra.problem` — the strategy-choice problem as numbers, :func:`evaluate`;
* :mod:`~planner.intra.ilp`, :mod:`~planner.intra.ilp_matrix` — the ILP and its sparse matrix (HiGHS, CBC);
* :mod:`~planner.intra.elimination` — exact variable elimination for the unconstrained problem;
* :mod:`~planner.intra.incumbents` — data-parallel and Megatron assignments that seed the solver;
* :mod:`~planner.intra.solve` — build, seed and solve one stage;
* :mod:`~planner.intra.logical_meshes` — the logical meshes a stage's devices can form;
* :mod:`~planner.intra.to_stage` — a solved stage as the plan's ``Stage``.

May import: :mod:`planner.costing` and everything it may import; highspy and pulp.
"""
