"""The ``multihost`` tier is skipped, by name, where network namespaces cannot be made."""

from __future__ import annotations

import functools

import pytest

from kvbridge.examples.netns import unavailable


@functools.cache
def _why_not() -> str:
    return unavailable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("multihost") is not None]
    if marked and (why := _why_not()):
        skip = pytest.mark.skip(reason=f"multihost tier: {why} (scripts/run_multihost.sh)")
        for item in marked:
            item.add_marker(skip)
