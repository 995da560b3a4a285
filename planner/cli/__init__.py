"""The ``plan`` command: one module per subcommand (:mod:`~planner.cli.main` dispatches).

* :mod:`~planner.cli.main` — ``plan MODEL_FILE ...`` and the dispatch to subcommands;
* :mod:`~planner.cli.options` — shared options, one-line usage errors and warnings;
* :mod:`~planner.cli.profile`, :mod:`~planner.cli.compare`, :mod:`~planner.cli.show`,
  :mod:`~planner.cli.run` (``run`` and ``compile``), :mod:`~planner.cli.calibrate` — the subcommands;
* :mod:`~planner.cli.explain_table`, :mod:`~planner.cli.plan_figure` (panels: :mod:`~planner.cli.plan_figure_grid`,
  :mod:`~planner.cli.plan_figure_timeline`) — rich tables and figures.

May import: everything, :mod:`executors` and :mod:`calibration` included — the only part of :mod:`planner`
that does, and the only one that renders with rich.
"""
