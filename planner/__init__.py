"""autoplan's planner: from a model and a cluster to a :class:`~planner.plan.Plan`. It decides; it never
imports torch.distributed.

Subpackages follow the data flow, and each imports only from those before it (import-linter
contracts in ``pyproject.toml``, run by ``lint-imports`` in CI)::

    errors  <-  ir | atomic_file  <-  (cost_models)  <-  sharding | plan  <-  costing  <-  options  <-  intra
            <-  inter  <-  baselines  <-  auto  <-  preparation  <-  methods  <-  tuning  <-  api  <-  compare
            <-  (calibration)  <-  cli

* :mod:`planner.errors`, :mod:`planner.atomic_file` — the error types and atomic writes: the floor every
  package (:mod:`cost_models`, :mod:`executors`, :mod:`calibration`) may import;
* :mod:`planner.ir` — model files and capture to an :class:`~planner.ir.graph.OpGraph`, layers;
* :mod:`planner.sharding` — sharding specs on a mesh and every operator's strategies;
* :mod:`planner.plan` — the Plan value (JSON, validation, report text), what executors read;
* :mod:`planner.costing` — seconds and bytes of a plan, the simulator's task graph;
* :mod:`planner.options` — :class:`~planner.options.PlanOptions`, every option as one checked value;
* :mod:`planner.intra` — one stage's per-operator sharding by ILP;
* :mod:`planner.inter` — pipeline stages on submeshes by DP, priced on whole stages;
* :mod:`planner.baselines` — data parallel, Megatron and uniform pipelines, op placements;
* :mod:`planner.auto`, :mod:`planner.preparation`, :mod:`planner.methods`, :mod:`planner.api`,
  :mod:`planner.compare` — the search, the captured model and its cost setup, the method registry, the
  library entry points, every method judged by one simulator;
* :mod:`planner.cli` — the ``plan`` command: the only place that imports :mod:`executors`, :mod:`calibration`
  or rich.

See ``docs/architecture.md``.
"""
