"""Fixtures shared by the e2e modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, run


@pytest.fixture(scope="session")
def demo_prepared() -> Path:
    """The demo corpus prepared in the checkout, as `make data` leaves it (a fresh clone has none: CI runs
    `make test`, not `make data`). Prepared once per session (~15 s on 2 cores) for every test that reads
    it: the docs' journey, the rollback runs, the corrupt-data copies. Tests only read it (a test that
    damages data damages its own copy)."""
    path = ROOT / "data" / "demo" / "prepared"
    if not (path / "meta.json").is_file():
        res = run([sys.executable, "-m", "megaframe.data.prepare"], timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    return path
