"""Moved to ``kvbridge.cli.bench.results`` (the benchmarks' ``--json`` documents); the names
read from here stay for one release."""

from kvbridge.cli.bench import results as _moved


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
