"""``python -m bench``: one CLI over the suite and the named feature benchmarks, one result format."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import bench
from bench.common import write_result

ROOT = Path(__file__).resolve().parents[2]


def test_every_named_benchmark_is_a_module_with_an_entry_taking_argv():
    for name, (entry, _) in bench.BENCHMARKS.items():
        module, _, function = entry.partition(":")
        function = function or "main"
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.exists(), f"{name}: {path} is missing"
        defs = [f for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef) and f.name == function]
        assert defs and [a.arg for a in defs[0].args.args] == ["argv"], f"{name}: {module}.{function}(argv) expected"


def test_no_name_and_suite_run_the_suite_with_its_options():
    seen = []
    assert bench.run(["--ranks", "1"], lambda argv: seen.append(argv)) == 0
    assert bench.run(["suite", "--rounds", "1"], lambda argv: seen.append(argv) or 3) == 3
    assert seen == [["--ranks", "1"], ["--rounds", "1"]]


def test_a_name_runs_that_benchmark_with_the_rest_of_the_arguments(tmp_path):
    folder = tmp_path / "zero"
    folder.mkdir()
    code = bench.run(["optim-zero-report", str(folder)], lambda argv: pytest.fail("the suite ran"))
    assert code == 1  # the benchmark's own answer: no optim-zero-*ranks.json in the folder


def test_an_unknown_name_is_refused_with_the_names_that_exist(capsys):
    assert bench.run(["tensr"], lambda argv: pytest.fail("the suite ran")) == 2
    err = capsys.readouterr().err
    assert "'tensr'" in err and "tensor" in err and "suite" in err


def test_help_lists_every_benchmark():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    for name in ["suite", *bench.BENCHMARKS]:
        assert f"  {name} " in out


def test_write_result_records_command_host_and_versions_in_both_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m bench tensor", "--steps", "4"])
    json_path, md_path = write_result(tmp_path / "tensor-x", {"rows": [1, 2]}, "# Tensor\n\n| a |\n|---|\n")
    record = json.loads(json_path.read_text())
    assert record["command"] == "python -m bench tensor --steps 4"
    assert record["rows"] == [1, 2] and record["host"]["cores"] >= 1 and "versions" in record["host"]
    assert record["host"]["commit"]  # the checkout's commit, or "unknown" outside one
    lines = md_path.read_text().splitlines()
    assert lines[:5] == ["# Tensor", "", "```", "python -m bench tensor --steps 4", "```"]
    assert lines[6].startswith(f"Commit {record['host']['commit']}; ")
    assert lines[-2:] == ["| a |", "|---|"]


def test_write_result_keeps_a_benchmarks_own_command_and_completes_its_host(tmp_path):
    record = {"command": "mpiexec -n 2 python -m bench exchange", "host": "box", "ms": 1.5}
    json_path, md_path = write_result(tmp_path / "exchange-box", record, "# Exchange\n")
    written = json.loads(json_path.read_text())
    assert written["command"] == "mpiexec -n 2 python -m bench exchange" and written["ms"] == 1.5
    assert isinstance(written["host"], dict) and written["host"]["cores"] >= 1
    assert "mpiexec -n 2 python -m bench exchange" in md_path.read_text().splitlines()
