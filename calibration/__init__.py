"""Calibration: this machine measured, its cost-model figures fitted, cached, and the runtime's overheads fitted
on probe plans run for real (``plan calibrate``, and every ``plan`` on ``local-cpu`` by default).

* :mod:`~calibration.machine` — :func:`~calibration.machine.calibrate_machine` (all of it, what ``plan
  calibrate`` runs) and :func:`~calibration.machine.planning_cluster` (the cluster a command prices with);
* :mod:`~calibration.measure` — processes, matmuls, memory and gloo collectives timed; the cluster file written;
* :mod:`~calibration.fit` — those samples fitted into a cluster's figures (pure);
* :mod:`~calibration.probes` — the probe plans planned, run and fitted (:mod:`~calibration.probe_model`: the
  model file they run);
* :mod:`~calibration.runtime_fit` — the fit of the executors' host overheads on the probes (pure);
* :mod:`~calibration.store` — calibrations cached per machine and process count.

The one room that needs both the planner (to plan the probes) and the executors (to run them): it imports
:mod:`planner` below :mod:`planner.cli`, :mod:`executors` and :mod:`cost_models`, and only :mod:`planner.cli`
imports it (import-linter contracts in ``pyproject.toml``).
"""
