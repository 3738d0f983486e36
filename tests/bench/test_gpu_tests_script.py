"""bench/gpu_tests.sh when the test process dies: the test it died in is reported as CRASH, the tests it finished as
DONE (the JUnit file is never written) and the rest as NOT RUN; run here on CPU with a planted test that aborts. The
run's exit status is its summary's verdict (bench/gpu_tests_summary.py), not pytest's alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_tests_summary

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


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_x" name="test_passes" time="3.5"/>
<testcase classname="tests.gpu.test_x" name="test_skips" time="0.0">
<skipped message="needs 4 GPUs (2 found)"/></testcase>
{extra}</testsuite></testsuites>"""
PLAN = ["tests/gpu/test_x.py::test_passes", "tests/gpu/test_x.py::test_skips", "tests/gpu/test_x.py::test_third"]


@pytest.mark.parametrize(
    ("third", "verdict", "line"),
    [
        ('<testcase classname="tests.gpu.test_x" name="test_third" time="1.0"/>', 0, "PASS"),
        ('<testcase classname="tests.gpu.test_x" name="test_third" time="1.0"><failure message="boom"/></testcase>', 1,
         "FAIL"),
        ("", 1, "NOT RUN"),
    ],
    ids=["all-passed-or-skipped", "one-failed", "one-not-run"],
)  # fmt: skip
def test_the_summary_passes_a_run_whose_every_test_passed_or_skipped_whatever_pytest_returned(
    tmp_path, capsys, third, verdict, line
):
    """pytest exits 1 when its session limit is reached as the last test ends, every test passed: the run passes; a
    failed or unrun test fails it whatever pytest returned."""
    xml, plan = tmp_path / "gpu-tests.xml", tmp_path / "plan.txt"
    xml.write_text(JUNIT.format(extra=third))
    plan.write_text("\n".join(PLAN) + "\n")
    for pytest_status in (0, 1):
        args = [str(xml), str(plan), str(tmp_path / "none.jsonl"), str(pytest_status)]
        assert gpu_tests_summary.main(args) == verdict
        summary = capsys.readouterr().out
        rows = {row.split("::")[-1].split()[0]: row.split()[0] for row in summary.splitlines() if "::" in row}
        assert rows == {"test_passes": "PASS", "test_skips": "SKIP", "test_third": line.split()[0]}, summary
        assert "needs 4 GPUs (2 found)" in summary


def test_a_run_that_collected_nothing_fails(tmp_path, capsys):
    (tmp_path / "plan.txt").write_text("")
    args = [str(tmp_path / "absent.xml"), str(tmp_path / "plan.txt"), str(tmp_path / "none.jsonl"), "5"]
    assert gpu_tests_summary.main(args) == 1
    assert capsys.readouterr().out.strip() == "totals:"


def test_named_gpu_test_files_run_alone_and_an_unknown_one_is_refused(tmp_path):
    """Files or tests under tests/gpu given as arguments select what runs; other arguments go to pytest."""
    env = {**os.environ, "ORTFLOW_PY": sys.executable, "OUT": str(tmp_path / "out"), "BUDGET_S": "120",
           "TEST_S": "60", "PYTHONPATH": str(REPO)}  # fmt: skip
    picked = "tests/gpu/test_gpu_setup.py"
    result = subprocess.run(["bash", "bench/gpu_tests.sh", picked, "-p", "no:xdist"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    plan = (tmp_path / "out" / "gpu-tests-plan.txt").read_text().split()
    assert plan and all(test.startswith(picked + "::") for test in plan), plan
    assert f"order: {picked}\n" in result.stdout
    refused = subprocess.run(["bash", "bench/gpu_tests.sh", "tests/gpu/test_gpu_absent.py"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2
    assert "no such GPU test file: tests/gpu/test_gpu_absent.py" in refused.stderr
