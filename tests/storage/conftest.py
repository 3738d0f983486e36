"""Fixtures of the object-storage tests: one SeaweedFS S3 server and bucket per test module, one fresh folder in it
per test (SeaweedFS gives every bucket its own volumes, so buckets are few)."""

from __future__ import annotations

import itertools
import os

import pytest

from tests.support.s3server import S3Server, weed_problem

_buckets = itertools.count()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A running S3 server whose standard AWS_* variables are set for the module's tests (and their child ranks)."""
    problem = weed_problem()
    if problem:
        pytest.skip(f"no S3 server: {problem}")
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    saved = {key: os.environ.get(key) for key in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def module_bucket(s3_server) -> str:
    return s3_server.make_bucket(f"ortflow-{os.getpid()}-{next(_buckets)}")


@pytest.fixture
def bucket(module_bucket, request) -> str:
    """``bucket/<test name>``: a new, empty folder on the module's server (use it where a bucket name goes)."""
    return f"{module_bucket}/{request.node.name[:60]}-{next(_buckets)}"
