"""Fixtures of the object-storage tests: the session's SeaweedFS S3 server (tests/conftest.py, shared with the other
test folders that use one), running and with its AWS_* variables set while each module runs, a bucket per module and
a fresh folder in it per test (tests/support/s3server.py)."""

from tests.support.s3server import fixtures

s3_server, module_bucket, bucket = fixtures()
