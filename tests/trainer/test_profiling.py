"""The top-operators table from ONNX Runtime's Chrome trace: a recorded trace, hand-made events, and a profiled
update in process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ortflow.trainer.profile_report import markdown_table, parse_steps, top_operators

#: Recorded by `train.profile_steps: [2, 4]` on tests/support/fixed_batch_mlp.py's classifier, 2 ranks x 2
#: micro-batches (rank 0).
RECORDED = Path(__file__).with_name("data") / "profile_fixed_batch_classifier.json"


def test_recorded_trace_gives_per_op_calls_totals_and_shares():
    rows = top_operators(RECORDED)
    ops = {r["op_type"]: r for r in rows}
    # 3 profiled updates x 2 micro-batches = 6 training runs; the classifier's graph has 4 Gemm nodes per run
    # (the backward MatMuls) and one ReluGrad, one SoftmaxCrossEntropyLoss(Grad).
    assert ops["Gemm"]["calls"] == 24
    assert ops["ReluGrad"]["calls"] == ops["SoftmaxCrossEntropyLoss"]["calls"] == 6
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    # Independently of the parser: every kernel event's duration, read with a regex from the raw text.
    raw = RECORDED.read_text()
    durations = [int(d) for d in re.findall(r'"dur"\s*:\s*(\d+)[^{}]*"name"\s*:\s*"[^"]*_kernel_time"', raw)]
    assert len(durations) == sum(r["calls"] for r in rows)
    assert sum(r["total_ms"] for r in rows) == pytest.approx(sum(durations) / 1000.0)
    assert ops["Gemm"]["mean_ms"] == pytest.approx(ops["Gemm"]["total_ms"] / 24)


def test_only_kernel_events_count_and_fences_and_sessions_do_not():
    events = [
        {"cat": "Session", "name": "model_run", "dur": 1000},
        {"cat": "Node", "name": "a_fence_before", "dur": 7, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "a_kernel_time", "dur": 300, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "b_kernel_time", "dur": 100, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "c_kernel_time", "dur": 600, "args": {"op_name": "Softmax"}},
    ]
    rows = top_operators(events)
    assert rows == [
        {"op_type": "Softmax", "calls": 1, "total_ms": 0.6, "mean_ms": 0.6, "share": 0.6},
        {"op_type": "MatMul", "calls": 2, "total_ms": 0.4, "mean_ms": 0.2, "share": 0.4},
    ]
    table = markdown_table(rows, {"steps": [1, 2], "forward_backward_s": 0.0011})
    assert "| Softmax | 1 | 0.60 | 0.600 | 60.0% |" in table
    assert "kernels 1.0 ms in all, forward+backward measured 1.1 ms" in table
    assert "kernels 5.0 ms in all" in markdown_table(rows[:1], {"steps": [1, 2], "forward_backward_s": 0.0}, 5.0)
    assert top_operators(events, limit=1)[0]["op_type"] == "Softmax"


def test_profile_option_parsing():
    assert parse_steps("3:7") == (3, 7)
    assert parse_steps("5") == (5, 5)
    for bad in ("0:2", "4:2", "a:b"):
        with pytest.raises(ValueError, match="--profile"):
            parse_steps(bad)


def test_recorded_trace_is_the_chrome_trace_format():
    events = json.loads(RECORDED.read_text())
    assert isinstance(events, list) and all({"ph", "ts", "name"} <= set(e) for e in events)


def test_top_operators_table_reads_rank_zeros_trace_of_a_run_folder(tmp_path):
    from ortflow.trainer.profile_report import top_operators_table

    assert top_operators_table(tmp_path) is None  # not profiled
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank-0.json").write_text(RECORDED.read_text())
    rows = top_operators_table(tmp_path, limit=3)
    assert len(rows) == 3 and rows[0]["op_type"] == "Gemm"
    assert set(rows[0]) == {"op_type", "calls", "total_ms", "mean_ms", "share"}


def test_a_profiled_update_logs_its_top_operators_counting_only_the_op_types_there_are(tmp_path, caplog):
    from ortflow.checkpoints import CheckpointManager
    from ortflow.checkpoints.h5state import write_state
    from ortflow.dataprep.loader import EvalLoader, TrainLoader
    from ortflow.trainer.comm import SingleProcessComm
    from ortflow.trainer.loop import StopFlag, train
    from ortflow.trainer.runtime import init_runtime
    from tests.support.runs import make_run

    cfg = make_run(tmp_path, "profiled", train={"num_train_steps": 2, "profile_steps": [2, 2]},
                   checkpoint={"period": 0})
    rt = init_runtime(cfg.output_dir, cfg, SingleProcessComm())
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    manager = CheckpointManager(cfg.checkpoints_dir, 0, 1, is_writer=True, writer=write_state)
    with caplog.at_level("INFO", logger="ortflow.trainer"):
        train(rt, loader.iter_from, EvalLoader(cfg.data_dir, 4, 0, 1, max_rows=0), manager, None, None, StopFlag())
    rows = top_operators(cfg.output_dir / "profile" / "rank-0.json")
    assert 1 < len(rows) < 10  # the MLP has fewer op types than the line shows at most
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("profile of updates 2..2"))
    assert f"(top {len(rows)} of {len(rows)} op types)" in line, line


def test_a_profile_option_past_the_runs_last_update_is_refused_before_any_rank_starts(tmp_path):
    from typer.testing import CliRunner

    from ortflow.cli import app
    from ortflow.config import config_from_dict, write_resolved_config

    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path / "m.onnx")},
                            "data": {"train": ["a.npz"]}, "train": {"batch_size": 2, "num_train_steps": 8,
                                                                     "gradient_accumulation_steps": 2}})
    write_resolved_config(cfg)
    result = CliRunner().invoke(app, ["train", str(cfg.output_dir), "--profile", "4:5"], terminal_width=300)
    assert result.exit_code == 1, result.output
    assert "--profile 4:5 ends after the run's 4 weight update(s)" in result.output, result.output
    assert not cfg.checkpoints_dir.exists()  # no rank started
