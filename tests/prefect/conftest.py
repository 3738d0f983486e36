"""A real local Prefect server (SQLite in a temporary PREFECT_HOME) for the pipeline tests, started once per session."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start ``prefect server start`` on a free port; yields the environment that points clients at it.

    The test process uses it through ``temporary_settings``; subprocesses (``ortflow serve``, ``prefect deployment
    run``) get the returned environment.
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        PREFECT_RUNNER_POLL_FREQUENCY,
        temporary_settings,
    )

    home = tmp_path_factory.mktemp("prefect-home")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        # The scheduler service creates runs of scheduled deployments; every 2 s instead of 60 s keeps tests short.
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        # A run waiting for its deployment's concurrency slot (one pipeline run at a time) is tried again after 1 s
        # instead of 30 s once the slot frees.
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
        # No flow run pauses or suspends itself: the service that expires paused runs (a query every 5 s) is off.
        "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": "false",
        # Nothing reads the event history (automations and task runs are built from the event stream itself): the
        # service that writes every event to the database is off, sparing SQLite the writes that lock it under load.
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
        # Nothing waits for a run to be marked Late (ortflow's late alert is its own automation; dropping a backlog
        # selects every Scheduled-type state): the service that marks them is off. Under load its writes failed with
        # "database is locked" every 5 s for minutes while a short schedule queued runs behind a running one.
        "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
        # Task runs are recorded from their events one at a time, one per incoming event or per flush interval: an
        # event the recorder cannot store (a task of a deleted flow run) is retried five times and delays the ones
        # queued behind it; a 1 s interval (instead of 5) drains such a queue sooner.
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PREFECT_API_URL", None)
    for attempt in range(3):  # the free port may be taken before the server binds it (another worker's server)
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        try:
            with _empty_database(home / "prefect.db") as start_settings:
                server, log = _start(port, {**env, **start_settings}, home, url)
            break
        except RuntimeError as err:
            if "address already in use" not in str(err) or attempt == 2:
                raise
    try:
        client_env = {**env, "PREFECT_API_URL": url}
        with temporary_settings(
            updates={
                PREFECT_API_URL: url,
                PREFECT_HOME: home,
                PREFECT_RESULTS_LOCAL_STORAGE_PATH: home / "storage",
                PREFECT_RUNNER_POLL_FREQUENCY: 1,
            }
        ):
            try:
                yield client_env
            finally:
                # Send the buffered run logs while the server is up (at exit they would go to an ephemeral server).
                from prefect.logging.handlers import APILogWorker

                APILogWorker.drain_all(timeout=10)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@contextlib.contextmanager
def _empty_database(database: Path) -> Iterator[dict[str, str]]:
    """Start the block's server on a copy of ortflow's cached empty database of this Prefect version (the one
    ``ortflow run``'s temporary server keeps: ``local_server.empty_database_cache``) when there is one, sparing its
    migrations and block registrations (seconds of CPU); else let it create the database and keep it as that cache.
    One xdist worker at a time: the second one starts from the copy the first one leaves. Yields the settings the
    server starts with."""
    import fcntl

    from ortflow.deployments import local_server

    cache = local_server.empty_database_cache()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.with_name(f"{cache.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        seeded = local_server._seed(database)
        # A copy is at this Prefect version's schema with its blocks registered, as for ortflow's temporary server.
        yield {"PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false",
               "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false"} if seeded else {}
        if not seeded:
            local_server._keep_empty(database)


def _start(port: int, env: dict[str, str], home: Path, url: str):
    """``prefect server start`` until it answers; returns the process and its open log file."""
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
        raise
    return server, log


@pytest.fixture(scope="session")
def mlp_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny MLP classifier model and a 256-row npz data set shared by the pipeline tests."""
    import numpy as np

    from ortflow.examples.mlp import build_mlp

    root = tmp_path_factory.mktemp("mlp-sources")
    model = build_mlp(root / "mlp.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    rng = np.random.default_rng(0)
    features = rng.normal(size=(256, 8)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
    np.savez(root / "data.npz", features=features, labels=labels)
    return {"model": model, "data": root / "data.npz"}


# The S3 server (SeaweedFS) of the remote-storage pipeline tests: the session's server (tests/conftest.py), set for the
# module by s3_server, a bucket per test.
from tests.support.s3server import fixtures as _s3_fixtures  # noqa: E402

s3_server, module_bucket, bucket = _s3_fixtures()
