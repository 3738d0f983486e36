"""Fixtures of the object-storage tests: one SeaweedFS S3 server and bucket per test module, a fresh folder in it per
test (tests/support/s3server.py)."""

from tests.support.s3server import fixtures

s3_server, module_bucket, bucket = fixtures()
