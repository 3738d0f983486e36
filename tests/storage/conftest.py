"""Fixtures of the object-storage tests: one SeaweedFS S3 server for the folder's modules that run in one process
(started once, stopped at the end), its AWS_* variables set while each module runs, a bucket per module and a fresh
folder in it per test (tests/support/s3server.py)."""

import pytest

from tests.support.s3server import environment, fixtures, started_server

_, module_bucket, bucket = fixtures()


@pytest.fixture(scope="session")
def storage_server(tmp_path_factory):
    server = started_server(tmp_path_factory)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_server(storage_server):
    """The server, running (a test may have stopped and started it), with its standard AWS_* variables set for the
    module's tests and their child ranks."""
    if storage_server.proc is None or storage_server.proc.poll() is not None:
        storage_server.start()
    with environment(storage_server.env):
        yield storage_server
