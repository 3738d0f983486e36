"""Every benchmark report starts with one provenance block: the command, then the commit (``+dirty`` with changes),
the host (CPU and cores, GPUs), Python, the package versions and the date."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from bench import bench_exports, bench_layout, large_llama
from bench.common import commit, host_info, provenance, with_provenance
from bench.report import _gpu_suite_markdown, render

ROOT = Path(__file__).resolve().parents[2]
INFO = {"host": "box", "cpu": "AMD EPYC", "cores": 2, "commit": "abc1234+dirty", "python": "3.11.9",
        "versions": {"numpy": "2.4.6", "onnxruntime": "1.19.2", "torch": None}, "date": "2026-11-30 10:00:00 UTC",
        "load_average_at_start": (1.5, 1.0, 0.5)}  # fmt: skip


def assert_starts_with_provenance(text: str, command: str, commit_id: str) -> str:
    """The title, then the block; returns the block's facts line."""
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2:6] == ["```", command, "```", ""], lines[:8]
    facts = lines[6]
    assert facts.startswith(f"Commit {commit_id}; "), facts
    assert "Python " in facts and "written " in facts, facts
    return facts


def _git(where: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(where), "-c", "user.email=a@b", "-c", "user.name=a", *args], check=True,
                   capture_output=True)  # fmt: skip


def test_commit_is_the_checkouts_short_hash_marked_dirty_with_changes_to_tracked_files(tmp_path):
    assert commit(tmp_path) == "unknown"  # not a git checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "a")
    sha = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    (tmp_path / "untracked.txt").write_text("x\n")
    assert commit(tmp_path) == sha  # untracked files do not count
    (tmp_path / "a.txt").write_text("two\n")
    assert commit(tmp_path) == sha + "+dirty"


def test_host_info_names_the_commit_of_this_checkout():
    assert host_info()["commit"] == commit()


def test_the_block_names_command_commit_host_gpus_python_versions_date_and_load():
    facts = provenance("python -m bench tensor --steps 4", {**INFO, "gpu": "NVIDIA H200, 143771 MiB"})
    assert facts[:4] == ["```", "python -m bench tensor --steps 4", "```", ""]
    assert facts[4] == ("Commit abc1234+dirty; box: AMD EPYC, 2 cores; GPUs NVIDIA H200, 143771 MiB; Python 3.11.9; "
                        "numpy 2.4.6, onnxruntime 1.19.2; written 2026-11-30 10:00:00 UTC, load average at start "
                        "(1.50, 1.00, 0.50).")  # fmt: skip
    assert provenance("x", {})[4] == "Commit unknown."


def test_with_provenance_puts_the_block_under_the_title_or_on_top():
    text = with_provenance("# Title\n\n\nbody\n", "cmd", INFO)
    assert_starts_with_provenance(text, "cmd", "abc1234+dirty")
    assert text.splitlines()[-1] == "body" and text.splitlines()[-2] == ""
    assert with_provenance("body", "cmd", INFO).splitlines()[:3] == ["```", "cmd", "```"]


def test_the_suite_report_starts_with_the_block():
    record = {"command": "python -m bench --rounds 1", "host": INFO, "runs": {}, "summary": {},
              "fraction_of_ceiling": {},
              "model": {"shape": {"seq_len": 128}, "num_params": 1e6, "train_flops_per_token": 6e6},
              "setup": {"batch_size": 8, "warmup_steps": 5, "timed_steps": 15},
              "ratios": {"trainer_overhead": {}, "weak_scaling_efficiency": {}, "ortflow_over_torch": {}},
              "ceiling": {"gemm_gflops_1_thread": 50.0, "gemm_gflops_all_threads": 90.0, "cores": 2}}  # fmt: skip
    facts = assert_starts_with_provenance(render(record, []), "python -m bench --rounds 1", "abc1234+dirty")
    assert "box: AMD EPYC, 2 cores" in facts and "numpy 2.4.6" in facts


def test_the_layout_report_starts_with_the_block(tmp_path):
    args = argparse.Namespace(global_batch=16, rounds=1, out=tmp_path, work=None)
    runs = {"ortflow auto": [{"samples_per_s": 4.0, "ranks": 2, "threads": 1, "round": 0}]}
    bench_layout.write_report(args, INFO, runs, 10.0, "layout-x", quiet=True)
    assert_starts_with_provenance((tmp_path / "layout-x.md").read_text(),
                                  "python -m bench.bench_layout --global-batch 16 --rounds 1", "abc1234+dirty")


def test_the_exports_report_starts_with_the_block():
    row = {"median_step_s": 0.5, "step_vs_dp2": 1.0, "state_vs_dp2": 1.0, "peak_resident_mib": 100.0}
    result = {"command": "python -m bench exports", "date": INFO["date"], "host": INFO, "global_batch_windows": 16,
              "layouts": {"dp2": row, "pp2": row}}  # fmt: skip
    args = argparse.Namespace(micro=2, updates=12, rounds=3)
    text = bench_exports.markdown(result, ["pp2"], args)
    assert_starts_with_provenance(text, "python -m bench exports", "abc1234+dirty")
    assert "| pp2 | 0.5000 | 1.00 |" in text


def test_the_gpu_suite_report_starts_with_the_block_naming_its_gpus():
    meta = {"date": "2026-11-30 10:00 UTC", "command": "python bench/gpu_suite.py", "host": INFO, "commit": "def5678",
            "gpus": "2 x NVIDIA H200", "ortflow_python": "3.11", "torch_python": "3.12", "mpiexec": "mpiexec",
            "cpus": 32, "env": {}, "seconds": 10.0, "budget_s": 100.0}  # fmt: skip
    summary = {"table": [], "ratios": {}, "zero": {}, "bucket_tuning": [], "fixtures": []}
    facts = assert_starts_with_provenance(_gpu_suite_markdown(summary, [], meta), "python bench/gpu_suite.py",
                                          "def5678")
    assert "GPUs 2 x NVIDIA H200" in facts


def test_the_large_llama_report_starts_with_the_block():
    meta = {**INFO, "command": "bash bench/large_llama.sh", "gpu": "NVIDIA H200", "parameters": 1e9, "gpus": 2}
    assert_starts_with_provenance(large_llama.render([], meta), "bash bench/large_llama.sh", "abc1234+dirty")


def test_every_bench_module_writing_markdown_writes_it_with_the_block():
    """A report written beside its JSON goes through write_result (or with_provenance / provenance directly)."""
    shared = {"write_result", "with_provenance", "provenance"}
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                 for n in ast.walk(tree) if isinstance(n, ast.Call)}  # fmt: skip
        if '.md"' in path.read_text() and path.name != "common.py":
            assert names & shared, f"{path.name} writes a .md without the provenance block"


def test_the_gpu_suite_driver_writes_its_report_with_the_standard_library_alone():
    """bench/gpu_suite.sh runs the driver on a Python that may lack numpy: the report modules must not need it."""
    code = ("import sys; sys.modules['numpy'] = None; import bench.report, bench.common; "
            "print(bench.common.provenance('c', bench.common.host())[4])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout  # fmt: skip
    assert out.startswith("Commit ")
