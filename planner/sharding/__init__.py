"""How a tensor and an operator are split over a device mesh, in DTensor's words.

* :mod:`~planner.sharding.specs` — ``ShardingSpec`` (``S(d)``/``R`` per mesh axis), ``StageMesh``
  (a stage's devices as a logical mesh with its links) and the seconds of resharding;
* :mod:`~planner.sharding.strategies` — ``NodeStrategy``: one way to run an operator on a mesh, with
  its input, output and parameter specs, compute split and collectives;
* :mod:`~planner.sharding.op_rules`, :mod:`~planner.sharding.view_rules` — every operator's strategies;
* :mod:`~planner.sharding.sequence_parallel` — Megatron sequence parallelism's variants of them.

May import: :mod:`planner.ir`, :mod:`planner.errors`, :mod:`cost_models` (links and collective formulas).
"""
