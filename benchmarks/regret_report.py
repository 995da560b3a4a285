"""The page of ``benchmarks/regret.py``: per world the scores, per case the regrets, per candidate every run."""

from __future__ import annotations


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _ratio(value: float | None, *, limit: float | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:.3f}"
    return f"**{text}**" if limit is not None and value > limit else text


def _run(row: dict, run: str) -> str:
    measured = row[run]
    if "median_s" not in measured:
        return f"failed: {measured['error']}"
    return f"{measured['median_s'] * 1e3:.1f} ({measured['steal'] + measured['foreign']:.0%})"


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _world_lines(result: dict) -> list[str]:
    """The per-world table: regrets of auto's and tune's picks, rank correlation and error of the estimates."""
    summary = [
        "| world | cases | auto regret: max | median | cases > 1.10 | tune regret: max | cases > 1.02 | "
        "Spearman (estimate vs measured) | MAPE | candidates | memory: mean abs error | within ±15% | "
        "more than 10% under |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world in result["worlds"]:
        scores, cases = world["scores"], world["cases"]
        over = sum((case["score"]["auto_regret"] or 0) > 1.10 for case in cases)
        tuned_over = sum((case["score"]["tune_regret"] or 0) > 1.02 for case in cases)
        summary.append(
            f"| {world['world']} | {len(cases)} | {_ratio(scores['auto_regret_max'], limit=1.10)} | "
            f"{_ratio(scores['auto_regret_median'], limit=1.03)} | {over} | "
            f"{_ratio(scores['tune_regret_max'], limit=1.02)} "
            f"| {tuned_over} | {_figure(scores['spearman'], '.2f')} | {_figure(scores['mape'], '.0%')} | "
            f"{scores['rows']} | "
            f"{_figure(scores['memory_error_mean'], '.0%')} | {scores['memory_within_15']}/{scores['rows']} | "
            f"{scores['memory_under_10']} |"
        )
    return summary


def _case_and_candidate_lines(result: dict) -> tuple[list[str], list[str]]:
    """The per-case table (each pick's regret) and the table of every candidate's estimate and both runs."""
    cases_table = [
        "| world | case | auto's pick | its regret | tune's pick (run A) | its regret | fastest (run B) |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = [
        "| world | case | candidate | plan | estimate ms | run A ms (steal + other) | run B ms (steal + other) | "
        "estimate ÷ B | estimated MiB | measured peak MiB (B, fullest rank) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world in result["worlds"]:
        for case in world["cases"]:
            score = case["score"]
            cases_table.append(
                f"| {world['world']} | {case['case']} | {case['auto']} | "
                f"{_ratio(score['auto_regret'], limit=1.10)} | "
                f"{score['tune_pick'] or '-'} | {_ratio(score['tune_regret'], limit=1.02)} | "
                f"{score['fastest'] or '-'} |"
            )
            for name, row in case["candidates"].items():
                measured_b = row["B"].get("median_s")
                peak = max(row["B"].get("peak_bytes", [0])) / 2**20 if measured_b else None
                runs.append(
                    f"| {world['world']} | {case['case']} | {name} | {row['shape']} | {_ms(row['estimate_s'])} | "
                    f"{_run(row, 'A')} | {_run(row, 'B')} | "
                    f"{_ratio(row['estimate_s'] / measured_b) if measured_b else '-'} | "
                    f"{row['memory_bytes'] / 2**20:.1f} | {'-' if peak is None else f'{peak:.1f}'} |"
                )
    return cases_table, runs


def page(result: dict) -> tuple[str, str, str]:
    """(title, description, tables) of the results page."""
    from benchmarks.regret import __doc__ as method

    title = "Regret, held out: auto's pick and plan tune's pick against the fastest candidate measured"
    summary = _world_lines(result)
    cases_table, runs = _case_and_candidate_lines(result)
    failed = [
        f"- world {world['world']}, {row['case']}: not planned ({row['error']})"
        for world in result["worlds"]
        for row in world.get("failed", [])
    ]
    calibrations = "; ".join(
        f"world {world['world']}: {world['calibration'].get('by', 'plan calibrate')} on "
        f"{world['calibration'].get('date', '?')}"
        for world in result["worlds"]
    )
    description = (
        method.split("\n\n", 1)[1].split("\n    python")[0].strip()
        + f"\n\nCalibrations used: {calibrations}. Steps: {result['warmup']} warm-up, {result['steps']} timed, median."
        f" Wall time {result['wall_s'] / 60:.0f} min. Bold: a target missed."
    )
    tables = "\n".join(
        [
            "## Per world",
            "",
            *summary,
            "",
            "## Per case",
            "",
            *cases_table,
            "",
            "## Every candidate, both runs",
            "",
            *runs,
            *(["", "## Cases that could not be planned", "", *failed] if failed else []),
        ]
    )
    return title, description, tables
