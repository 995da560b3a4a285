"""Inter-operator parallelism: pipeline stages on submeshes (Alpa §5), priced on whole stages.

* :mod:`~planner.inter.layer_costs` — per layer kind, mesh and microbatch size: a table of options;
* :mod:`~planner.inter.stage_dp` — the stage DP over layers and submeshes, with its submeshes and boundary table;
* :mod:`~planner.inter.search` — microbatch counts, layer tables and the DP: the pipeline search;
* :mod:`~planner.inter.stage_pricing` — a candidate's stages rebuilt and priced exactly as plan stages;
* :mod:`~planner.inter.pricing` — a candidate pipeline's step, memory and bubble from its priced stages;
* :mod:`~planner.inter.data_parallel_step` — the pure data-parallel plan under each gradient sync offered;
* :mod:`~planner.inter.data_parallel_levels` — a one-stage data-parallel candidate at its fastest ZeRO level;
* :mod:`~planner.inter.sp_saving` — what sequence parallelism saves on each stage of the chosen plan.

May import: :mod:`planner.intra` and everything it may import.
"""
