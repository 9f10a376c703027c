"""Fixtures of the multi-host tests: emulated machines (bench/hosts.py), skipped where they cannot be made."""

from __future__ import annotations

import pytest

from bench.hosts import why_unavailable

WHY = why_unavailable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if WHY is None:
        return
    for item in items:
        if "multihost" in str(item.path):
            item.add_marker(pytest.mark.skip(reason=f"no emulated hosts here: {WHY}"))
