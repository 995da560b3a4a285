"""Planning work cannot grow unseen: the CI cases of :mod:`benchmarks.work_counts` against their saved counts.

A count past 1.5× its figure in ``benchmarks/results/work_counts.json`` fails, as does a case that planned and now
does not (or the reverse); after a change that really needs the work, ``python -m benchmarks.work_counts --save``
rewrites the file and the diff shows the new figures.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.work_counts import CASES, CI_CASES, GOLDEN, GROWTH_LIMIT, compare, count_work

GOLDEN_CASES = json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_planning_work_stays_within_its_saved_counts(case) -> None:
    found = count_work(case)
    grown = compare(found, GOLDEN_CASES[case.name])
    assert not grown, f"{case.name}: {'; '.join(grown)} (python -m benchmarks.work_counts --save if intended)"


def test_the_comparison_fails_on_growth_and_on_a_lost_plan() -> None:
    golden = {"exported_operators": 100, "layer_problems": 10, "candidates_priced": 2, "simulated_tasks": 0}
    golden["outcome"] = "1 stage(s), 8 microbatches"
    assert compare(dict(golden), golden) == []
    assert compare({**golden, "exported_operators": int(100 * GROWTH_LIMIT) + 1}, golden)
    assert compare({**golden, "simulated_tasks": 1}, golden) == []  # one more than nothing is not growth
    assert compare({**golden, "outcome": "error: does not fit"}, golden)


def test_every_case_has_saved_counts() -> None:
    assert {c.name for c in CASES} <= set(GOLDEN_CASES)
