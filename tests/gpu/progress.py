"""A pytest plugin for bench/gpu_tests.sh: one JSON line per test as it starts and as it ends, written and flushed at
once to the file named by ``ORTFLOW_TEST_PROGRESS``, so a test process that dies (cuDNN aborts at a convolution whose
library is missing, a segfault in a driver) still leaves which test it was in; the JUnit file is written only at the
end of a session that lives to see it."""

from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    path = os.environ.get("ORTFLOW_TEST_PROGRESS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001 - pytest's hook signature
    _write({"node": nodeid, "event": "start"})


def pytest_runtest_logfinish(nodeid, location):  # noqa: ARG001 - pytest's hook signature
    _write({"node": nodeid, "event": "finish"})
