"""The trainer's tests configure each model and layout once per test process: a run whose configure fingerprint (model
bytes, model section, layout) matches an earlier run's starts from a copy of that run's artifacts, which configure
verifies and reuses (tests/support/runs.py)."""

from __future__ import annotations

import pytest

from tests.support import runs


@pytest.fixture(autouse=True)
def _reuse_configured(monkeypatch):
    monkeypatch.setattr(runs, "REUSE_CONFIGURED", True)


@pytest.fixture(scope="session")
def export_references(tmp_path_factory):
    """The unsplit reference of each committed export, by file name, trained once per test process whichever tests
    ask for it (tests/trainer/exports_checks.py: :func:`~tests.trainer.exports_checks.reference_of`)."""
    return {"factory": tmp_path_factory}


@pytest.fixture(scope="module")
def export_dp(request, export_references):
    """The unsplit reference of a committed export (parametrised indirectly by the tests that use it): one rank, the
    same global batch as every other layout, trained once per test process (``export_references``)."""
    from tests.trainer.exports_checks import reference_of

    return reference_of(export_references, request.param)


@pytest.fixture(scope="module")
def export_dp2(export_dp):
    """dp 2 on ``export_dp``'s global batch, trained (tests/trainer/exports_checks.py)."""
    from tests.trainer.exports_checks import dp2_run

    return dp2_run(export_dp)
