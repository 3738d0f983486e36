"""The trainer's tests configure each model and layout once per test process: a run whose configure fingerprint (model
bytes, model section, layout) matches an earlier run's starts from a copy of that run's artifacts, which configure
verifies and reuses (tests/support/runs.py). Their ranks run one intra-op thread each where the config leaves the
count to the host (``runs.ONE_THREAD``)."""

from __future__ import annotations

import pytest

from tests.support import runs


@pytest.fixture(autouse=True)
def _reuse_configured(monkeypatch):
    monkeypatch.setattr(runs, "REUSE_CONFIGURED", True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """One thread per rank from the start of each test here, before its fixtures start any job (a session's or
    module's run included), until its teardown ends: tests elsewhere keep the host's count."""
    runs.ONE_THREAD = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    runs.ONE_THREAD = False


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


@pytest.fixture(scope="session")
def gpt_unsplit(tmp_path_factory):
    """The 2-layer GPT's unsplit run (tests/support/parallel_runs.py's ``gpt_run``: one rank, AdamW, 4 updates, a
    checkpoint after each), the reference of the tensor-parallel tests (test_tensor_mpi.py) and of the pp x tp tests
    (test_pipe_tensor_mpi.py), trained once per test process: its config and the future of its output (it trains
    while the split runs configure)."""
    from tests.support.parallel_runs import EVERY, gpt_run
    from tests.support.runs import start_ranks

    cfg = gpt_run(tmp_path_factory.mktemp("gpt-unsplit"), "tp1", distributed={"num_ranks": 1}, checkpoint=EVERY)
    return cfg, start_ranks(cfg, timeout=600)
