"""The report: the issues' goals judged against the measured figures, a markdown version, and the JSON file.

Nothing here invents a number: every figure comes from the run's report dict, and a goal that the run did not
measure (its workload was left out, or there was no draft head) is "not measured", never met.

| module | what |
|---|---|
| `measured.py` | reading the report dict: a workload's row, totals and ratios over workloads, whether a csd column rescued anything, why a head column runs at its speed |
| `goals.py` | the goals of issues 8, 11, 18 and 19 and their verdicts (met, missed, within noise, not measured): `evaluate_goals` |
| `findings.py` | what the figures add up to beside the goals: the drafters compared, the fact guard's effect, what limits the speed, each drafter's cost |
| `tables.py` | the markdown tables (every method, against float32, the goals, the drafters) and the columns' legend |
| `sections.py` | the markdown sections on what CSD changed: fact-changing rescues, rescued patterns, changed facts, refused rescues |
| `document.py` | the two files: `markdown` (report.md in reading order) and `write_json` (report.json) |

`bench.run` and `bench.cli` import from the package, not from its modules, so the layout can change
without them.
"""  # noqa: E501

from __future__ import annotations

from bench.reports.document import markdown, write_json
from bench.reports.findings import drafter_comparison, drafter_cost_lines, fact_guard_effect, limits
from bench.reports.goals import (
    GAIN_WORKLOADS,
    IDLE_NOTE,
    NOISE,
    SERVED,
    evaluate_goals,
    head_goals,
    ngram_goals,
    quality_goals,
    served_goals,
)
from bench.reports.measured import DRAFTER_COLUMNS, GOAL_WORKLOAD, HEAD_WORKLOAD
from bench.reports.sections import (
    fact_changes_section,
    output_facts_section,
    refusals_section,
    rescued_section,
)
from bench.reports.tables import COLUMN_HELP, COLUMNS, comparison_table, fp32_table, goals_table, main_table

__all__ = [
    "COLUMNS",
    "COLUMN_HELP",
    "DRAFTER_COLUMNS",
    "GAIN_WORKLOADS",
    "GOAL_WORKLOAD",
    "HEAD_WORKLOAD",
    "IDLE_NOTE",
    "NOISE",
    "SERVED",
    "comparison_table",
    "drafter_comparison",
    "drafter_cost_lines",
    "evaluate_goals",
    "fact_changes_section",
    "fact_guard_effect",
    "fp32_table",
    "goals_table",
    "head_goals",
    "limits",
    "main_table",
    "markdown",
    "ngram_goals",
    "output_facts_section",
    "quality_goals",
    "refusals_section",
    "rescued_section",
    "served_goals",
    "write_json",
]
