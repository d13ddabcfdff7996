"""Benchmarks (`pdmesh bench <what>`): tools, kept apart from the service code."""

from __future__ import annotations

import json
from collections.abc import Mapping


def print_report(report: Mapping[str, object], as_json: bool, decimals: int) -> None:
    """One `key value` line a figure, or (with --json) the report as the last stdout line."""
    if not as_json:
        for key, value in report.items():
            print(f"{key:32s} {value:.{decimals}f}" if isinstance(value, float)
                  else f"{key:32s} {value}")
    print(json.dumps(report) if as_json else "")
