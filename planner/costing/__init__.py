"""What a plan costs, in seconds and bytes, read from the plan itself: no search decision in here.

* :mod:`~planner.costing.setup` — ``CostSetup`` (cluster, compute model, optimizer, memory budget);
* :mod:`~planner.costing.estimate` — closed-form estimates (data parallelism, optimizer step, MFU);
* :mod:`~planner.costing.node_cost` — one node under one strategy: what the ILP and the simulator both charge;
* :mod:`~planner.costing.records` — a strategy as the plan stores it, and back, priced;
* :mod:`~planner.costing.stage_work` — every node's work on a plan's stage, and the explanation rows;
* :mod:`~planner.costing.lowering` — a plan as a task graph for :mod:`cost_models.simulator`.

May import: :mod:`planner.ir`, :mod:`planner.sharding`, :mod:`planner.plan`, :mod:`planner.errors`,
:mod:`cost_models`. Never the search (:mod:`planner.intra`, :mod:`planner.inter`,
:mod:`planner.baselines` and above).
"""
