"""The trainer's tests configure each model and layout once per test process: a run whose configure fingerprint (model
bytes, model section, layout) matches an earlier run's starts from a copy of that run's artifacts, which configure
verifies and reuses (tests/support/runs.py)."""

from __future__ import annotations

import pytest

from tests.support import runs


@pytest.fixture(autouse=True)
def _reuse_configured(monkeypatch):
    monkeypatch.setattr(runs, "REUSE_CONFIGURED", True)
