"""The test helpers that start rank jobs (tests/support/runs.py)."""

from __future__ import annotations

import os
import sys

from tests.support import runs


def test_a_job_started_in_the_background_starts_in_the_launch_folder_whatever_the_tests_folder_is(tmp_path):
    # configure makes a scratch folder the current one while it builds split artifacts; a job a background thread
    # starts meanwhile must not inherit it (the folder is renamed when the build ends).
    command = [sys.executable, "-c", "import os; print(os.getcwd())"]
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        job = runs._pool().submit(runs._run, command, 60)
        out = job.result()
    finally:
        os.chdir(here)
    assert out.returncode == 0 and out.stdout.strip() == runs._LAUNCH_DIR != str(tmp_path), out.stdout
