"""The slowest test files run first.

`make test` gives whole files to its processes (`--dist loadfile --no-loadscope-reorder`), one after another in
the order collected here: longest first, from tests/durations.json (seconds per file, written by
tools/test_durations.py), so that no long file starts last while the other processes sit idle. A file missing from the
table counts as short; tests inside a file keep their order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("durations.json")


def _seconds() -> dict[str, float]:
    try:
        return {str(name): float(seconds) for name, seconds in json.loads(TABLE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no table: pytest's own order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:  # noqa: ARG001
    seconds = _seconds()
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], index)
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0), first[item.nodeid.split("::")[0]]))


# One SeaweedFS S3 server per test process, for every test folder whose conftest.py takes s3_server from
# tests/support/s3server.py's fixtures() (started on first use, stopped at the end of the session).
from tests.support.s3server import session_fixture as _s3_session_fixture  # noqa: E402

storage_server = _s3_session_fixture()
