"""``python -m planner`` is the ``plan`` command."""

from planner.cli.main import entry

entry()
