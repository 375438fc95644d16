"""``--json PATH`` for the benchmarks: the rows of their table as one JSON document.

Every benchmark that takes ``--json`` still prints its table; the JSON holds the same rows
plus what a reader needs to judge them (the command line, the machine's CPUs and load
average when the run ended, the benchmark's own settings). ``scripts/plot_bench.py`` draws
the PNGs in ``docs/img/`` from these files::

    {"schema": 1, "bench": "bench_transfer", "argv": [...], "created": "2026-...Z",
     "host": {"cpus": 2, "loadavg": [1.2, 1.0, 0.9]}, "config": {...}, "rows": [{...}, ...]}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

SCHEMA = 1


class BenchJSONError(ValueError):
    """A results file that is not what the reader expects (schema, benchmark, rows)."""


def add_json_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        default=None,
        help="also write the results as JSON to PATH (scripts/plot_bench.py draws them)",
    )


def _clean(value: Any) -> Any:
    """JSON has no NaN: a missing figure is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(
    path: Path | None, bench: str, rows: list[dict[str, Any]], **config: Any
) -> dict[str, Any] | None:
    """Write the document to ``path`` (nothing when ``path`` is None) and return it."""
    if path is None:
        return None
    if not rows:
        raise BenchJSONError(f"{bench}: no rows to write to {path}")
    doc = {
        "schema": SCHEMA,
        "bench": bench,
        "argv": sys.argv[1:],
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
        "config": _clean(config),
        "rows": _clean(rows),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results written to {path}", flush=True)
    return doc


def read_json(path: Path, bench: str) -> dict[str, Any]:
    """The document in ``path``, checked to come from ``bench`` in this schema."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchJSONError(f"{path}: not a results file: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise BenchJSONError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA}")
    if doc.get("bench") != bench:
        raise BenchJSONError(f"{path}: written by {doc.get('bench')!r}, expected {bench!r}")
    if not isinstance(doc.get("rows"), list) or not doc["rows"]:
        raise BenchJSONError(f"{path}: no rows")
    return doc
