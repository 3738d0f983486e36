"""bench/gpu_tests.sh when the test process dies: the test it died in is reported as CRASH, the tests it finished as
DONE (the JUnit file is never written) and the rest as NOT RUN; run here on CPU with a planted test that aborts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_test_that_kills_the_process_is_named_in_the_summary(tmp_path):
    demo = tmp_path / "test_planted.py"
    demo.write_text("import os\n\n"
                    "def test_planted_first():\n    assert True\n\n"
                    "def test_planted_abort():\n    os.abort()\n\n"
                    "def test_planted_last():\n    assert True\n")  # fmt: skip
    out = tmp_path / "out"
    env = {**os.environ, "ORTFLOW_PY": sys.executable, "OUT": str(out), "BUDGET_S": "120", "TEST_S": "60",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    result = subprocess.run(["bash", "bench/gpu_tests.sh", str(demo), "-k", "planted", "-p", "no:xdist"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    summary = (out / "gpu-tests-summary.txt").read_text()
    assert result.returncode != 0, summary
    lines = {line.split("::")[-1].split()[0]: line.split()[0] for line in summary.splitlines() if "::" in line}
    assert lines == {"test_planted_first": "DONE", "test_planted_abort": "CRASH", "test_planted_last": "NOT"}, summary
    assert "the test process died in this test" in summary
