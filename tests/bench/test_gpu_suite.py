"""The GPU suite's driver without a GPU: the plan's commands, the budget, failures and the report."""

from __future__ import annotations

import json
import sys

from bench.gpu_suite import Row, Suite, main
from bench.report import gpu_suite_summary as summarize


def _plan(tmp_path, *extra):
    out = tmp_path / "out"
    main(["--out", str(out), "--work", str(tmp_path / "w"), "--dry-run", "--gpus", "4", "--mpiexec", "MPIEXEC",
          "--ortflow-py", "OPY", "--torch-py", "TPY", *extra])
    return json.loads((out / "gpu-suite.json").read_text())["rows"], out


def test_plan_runs_every_contender_at_every_gpu_count_in_each_round(tmp_path):
    rows, out = _plan(tmp_path)
    names = [r["name"] for r in rows]
    for rnd in (1, 2, 3):
        for world in (1, 2, 4):
            for prec in ("fp32", "fp16", "bf16"):
                row = next(r for r in rows if r["name"] == f"r{rnd}-ortflow-{prec}-x{world}")
                assert row["command"].startswith(f"MPIEXEC -n {world} OPY bench/bench_mixed.py steps ")
        assert f"r{rnd}-ortflow-fp16-zero1-x4" in names and f"r{rnd}-ortflow-fp16-zero1-x2" not in names
    for world in (1, 2, 4):  # PyTorch: one process per GPU count, in round 1, timing all three rounds
        torch = next(r for r in rows if r["name"] == f"r1-torch-x{world}")
        assert torch["command"].startswith(f"TPY -m torch.distributed.run --nnodes=1 --nproc_per_node={world} "
                                           "--master_addr=127.0.0.1")  # fmt: skip
        assert "--rounds 3" in torch["command"]
        assert names.index(f"r1-ortflow-bf16-x{world}") < names.index(f"r1-torch-x{world}")
    assert not any(n.startswith(("r2-torch", "r3-torch")) for n in names)
    modes = {r["name"]: r["command"].split("--modes ")[1].split()[0] for r in rows if "-torch-" in r["name"]}
    assert modes["r1-torch-x1"] == "eager,compile,cudagraphs,fp32"  # CUDA graphs and the fp32 side note: one GPU
    assert modes["r1-torch-x4"] == "eager,compile,fsdp2"
    # the fixtures come after round 1 and before round 2, all six
    fixtures = [i for i, n in enumerate(names) if n.startswith("fixture-") and "config" not in n]
    assert len(fixtures) == 6 and names.index("r1-torch-x4") < fixtures[0] < names.index("r2-ortflow-fp32-x1")
    assert {"kernel-table-test", "adasum-test"} <= set(names)
    assert all(r["status"] == "planned" for r in rows)
    assert (out / "gpu-suite.md").exists() and (out / "logs.tgz").exists()


def test_gpu_counts_beyond_the_machine_are_not_planned(tmp_path):
    rows, _ = _plan(tmp_path, "--gpus", "2", "--rounds", "1")
    names = {r["name"] for r in rows}
    assert "r1-ortflow-fp16-x2" in names and not any(n.endswith("-x4") for n in names)
    assert "r1-ortflow-fp16-zero1-x2" in names  # the largest count here


def _suite(tmp_path, budget=100.0):
    class Args:
        work, budget_s, dry_run, device, precisions = str(tmp_path), budget, False, "cpu", "fp32"
        ortflow_pythonpath = ""
        mpiexec, ortflow_py, torch_py = "mpiexec", sys.executable, sys.executable

    suite = Suite(Args())
    suite.logs.mkdir(parents=True)
    return suite


def test_a_failing_row_keeps_its_error_tail_and_the_next_row_runs(tmp_path):
    suite = _suite(tmp_path)
    bad = suite.execute(Row("bad", "x", [sys.executable, "-c", "import sys; print('boom here'); sys.exit(3)"], 60, 0))
    good = suite.execute(Row("good", "x", [sys.executable, "-c", "print('RESULT {\"kind\": \"k\", \"v\": 1}')"], 60, 0))
    assert bad.status == "failed" and "exit 3" in bad.error_tail and "boom here" in bad.error_tail
    assert good.status == "ok" and good.results == [{"kind": "k", "v": 1}]
    assert "boom here" in (tmp_path / "logs" / "bad.log").read_text().splitlines()  # the output is kept


def test_rows_beyond_the_budget_are_skipped_and_a_slow_row_is_stopped(tmp_path):
    suite = _suite(tmp_path, budget=3.0)
    skipped = suite.execute(Row("big", "x", [sys.executable, "-c", "pass"], 60, estimate_s=100))
    assert skipped.status == "skipped" and "time budget" in skipped.error_tail
    slow = suite.execute(Row("slow", "x", [sys.executable, "-c", "import time; time.sleep(60)"], 60, 0))
    assert slow.status == "timeout" and slow.seconds < 30


def _timed(name, kind, key, world, rnd, ms, **extra):
    record = {"kind": kind, key: name, "world": world, "step_time_s": ms / 1e3, "status": "ok", **extra}
    return Row(f"r{rnd}-{name}-x{world}", f"round {rnd}", ["x"], 1, 0, world=world, round=rnd, status="ok",
               results=[record])


def test_report_medians_weak_scaling_ratios_and_zero():
    rows = []
    for rnd, (a, b, c) in enumerate([(20.0, 21.0, 22.0), (22.0, 20.0, 24.0), (21.0, 25.0, 23.0)], start=1):
        rows += [_timed("fp16", "ortflow", "precision", 1, rnd, a), _timed("fp16", "ortflow", "precision", 4, rnd, c,
                                                                           update_time_s=0.004,
                                                                           optimizer_state_mib_per_gpu=746.0),
                 _timed("fp16-zero1", "ortflow", "precision", 4, rnd, b, update_time_s=0.001,
                        optimizer_state_mib_per_gpu=186.5, zero_stage=1),
                 _timed("compile", "torch", "mode", 1, rnd, 15.0 + rnd)]
    rows.append(Row("r1-torch-x2", "round 1", ["x"], 1, 0, world=2, round=1, status="failed", error_tail="exit 1\nOOM",
                    results=[{"kind": "torch", "mode": "fsdp2", "world": 2, "status": "failed"}]))
    summary = summarize(rows)
    fp16 = next(e for e in summary["table"] if e["contender"] == "ortflow fp16 (defaults)")
    assert fp16["ms"][1] == "21.0 (20.0 / 22.0 / 21.0)"
    assert fp16["weak_scaling"] == {4: round(21.0 / 23.0, 3)}
    assert summary["ratios"]["x1 ortflow fp16 speed vs torch.compile"] == round(17.0 / 21.0, 3)
    assert summary["zero"]["fp16-zero1 x4"]["optimizer_mib_per_gpu"] == 186.5
    assert summary["zero"]["fp16-zero1 x4"]["update_ms"] == 1.0 and summary["zero"]["fp16 x4"]["update_ms"] == 4.0
    assert not any("FSDP2" in e["contender"] for e in summary["table"])  # a failed row has no time


def test_a_whole_suite_on_cpu_ranks_reports_ortflow_and_zero_rows(tmp_path):
    from tests.support.runs import MPIEXEC

    out = tmp_path / "out"
    main(["--out", str(out), "--work", str(tmp_path / "w"), "--device", "cpu", "--shape", "tiny", "--gpus", "2",
          "--worlds", "1,2", "--rounds", "1", "--precisions", "fp32", "--zero-precision", "fp32",
          "--fixture-precisions", "", "--torch-modes", "", "--steps", "3", "--warmup", "1", "--mpiexec", MPIEXEC,
          "--ortflow-py", sys.executable, "--budget-s", "600"])  # fmt: skip
    report = json.loads((out / "gpu-suite.json").read_text())
    status = {r["name"]: r["status"] for r in report["rows"]}
    assert status == {"prepare-model": "ok", "prepare-fp32": "ok", "prepare-fp32-zero1": "ok",
                      "r1-ortflow-fp32-x1": "ok", "r1-ortflow-fp32-x2": "ok", "r1-ortflow-fp32-zero1-x2": "ok"}
    zero = report["summary"]["zero"]
    assert zero["fp32-zero1 x2"]["zero_stage"] == 1 and zero["fp32 x2"]["zero_stage"] == 0
    assert zero["fp32-zero1 x2"]["optimizer_mib_per_gpu"] < zero["fp32 x2"]["optimizer_mib_per_gpu"]
    assert "ortflow fp32 (defaults)" in (out / "gpu-suite.md").read_text()


def test_a_row_whose_ranks_report_another_world_size_fails_and_keeps_no_results(tmp_path):
    suite = _suite(tmp_path)
    singleton = "print('RESULT {\"kind\": \"ortflow\", \"world\": 1, \"step_time_s\": 0.1}')"
    # What a launcher that starts 2 singletons prints: two rank-0 results of a world of 1.
    twice = [sys.executable, "-c", f"{singleton}\n{singleton}"]
    row = suite.execute(Row("r1-ortflow-fp32-x2", "round 1", twice, 60, 0, world=2))
    assert row.status == "failed" and row.results == []
    assert "report world size 1, asked for 2" in row.error_tail and "singletons" in row.error_tail
    two = [sys.executable, "-c", "print('RESULT {\"kind\": \"ortflow\", \"world\": 2, \"step_time_s\": 0.1}')"]
    assert suite.execute(Row("r1-ortflow-fp32-x2b", "round 1", two, 60, 0, world=2)).status == "ok"
    silent = [sys.executable, "-c", "print('RESULT {\"kind\": \"ortflow\", \"step_time_s\": 0.1}')"]
    assert suite.execute(Row("r1-ortflow-fp32-x2c", "round 1", silent, 60, 0, world=2)).status == "failed"
