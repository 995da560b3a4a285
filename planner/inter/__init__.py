"""Inter-operator parallelism: pipeline stages on submeshes (Alpa §5), priced on whole stages.

* :mod:`~planner.inter.layer_costs` — per layer kind, mesh and microbatch size: a table of options;
* :mod:`~planner.inter.stage_dp` — the stage DP over layers and submeshes;
* :mod:`~planner.inter.device_blocks` — submeshes and the global ranks they take;
* :mod:`~planner.inter.search` — microbatch counts, layer tables and the DP: the pipeline search;
* :mod:`~planner.inter.pricing` — candidate stages rebuilt and priced exactly as plan stages.

May import: :mod:`planner.intra` and everything it may import.
"""
