"""What ``ortflow run`` prints on a tiny run: lines of at most 120 columns, a line per stage, compact progress lines
when the output is not a terminal, the summary and the next steps; the ranks', the engine's and Prefect's state lines
only in the run's log file (``--verbose`` shows them: tests/prefect/test_run_cli.py). A rerun of the same run folder
says which stage is unchanged; a failed stage is reported as its own message and the command to rerun or fix (the
traceback only in the log file) and is not retried when it would fail again. The train stage refuses a TensorBoard
folder that takes no files before any rank starts, and starts no ranks for a run whose final checkpoint exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.prefect_runs import mlp_config, write_config

pytestmark = pytest.mark.prefect

ORTFLOW = str(Path(sys.executable).parent / "ortflow")
#: Lines that belong in the log file, not the terminal: the ranks' internals, the engine's, Prefect's state lines.
INTERNAL = ("gradient scales folded", "parameters sha256", "Saved training model", "Finished in state",
            "Beginning flow run", "launching:", "View at")


def test_the_terminal_shows_stages_progress_summary_and_next_steps_and_the_log_keeps_the_rest_and_a_failed_stage_its_message_and_fix(  # noqa: E501
    prefect_server, mlp_sources, tmp_path
):
    cfg = mlp_config(tmp_path, mlp_sources, "terminal", train={"num_train_steps": 20, "display_loss_steps": 5},
                     distributed={"num_ranks": 1, "threads_per_rank": 1})  # one rank's lines are the log's
    config_file = write_config(cfg, tmp_path / "terminal.yaml")
    done = subprocess.run([ORTFLOW, "run", str(config_file)], env=prefect_server, capture_output=True, text=True,
                          timeout=400, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 120, [line for line in lines if len(line) > 120]
    for stage in ("configure", "prepare data", "train", "keep checkpoints", "export"):
        assert f"▸ {stage}" in lines, out
        assert any(re.fullmatch(rf"✓ {stage} \(\d+m?\d*s\)", line) for line in lines), out
    progress = [line for line in lines if line.startswith("  train step ")]
    assert progress and progress[-1].startswith("  train step 20/20 · loss "), out
    assert "final eval loss" in out and "next steps:" in out
    assert "  loss curves:     tensorboard --logdir terminal/tensorboard" in lines, out
    assert "docs/your-model.md" in out
    log_file = Path(re.search(r"full log: +(\S+)", out)[1])
    log = (tmp_path / log_file).read_text()
    for text in INTERNAL[:2] + INTERNAL[3:5]:
        assert text not in out, text
        assert text in log, text

    # The same run folder with a file where the export folder should be: training is unchanged (cached), the export
    # stage fails once (an error that would repeat is not retried) and the terminal says what to fix.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the export folder should be")
    bad = mlp_config(tmp_path, mlp_sources, "terminal", train={"num_train_steps": 20, "display_loss_steps": 5},
                     distributed={"num_ranks": 1, "threads_per_rank": 1}, export={"path": str(blocker / "model.onnx")})
    bad_file = write_config(bad, tmp_path / "bad-export.yaml")
    again = subprocess.run([ORTFLOW, "run", str(bad_file)], env=prefect_server, capture_output=True, text=True,
                           timeout=400, cwd=tmp_path)
    out = again.stdout + again.stderr
    assert again.returncode == 1, out[-3000:]
    assert "✓ train (unchanged)" in out.splitlines(), out
    assert "Traceback" not in out
    assert re.search(r"error: pipeline failed: .*not-a-folder", out), out[-3000:]
    assert f"fix the problem above, then: ortflow run {bad_file}" in out
    log_file = tmp_path / re.search(r"full log with tracebacks: (\S+)", out)[1]
    assert log_file.parent == cfg.output_dir / "logs"
    log = log_file.read_text()
    assert "Traceback (most recent call last)" in log  # kept for whoever needs it
    assert re.search(r"prefect\.task_runs 'train-\w+' \| Finished in state Cached", log), log[-3000:]
    # An error that would repeat is not retried: the export task fails once and the flow fails right after.
    assert "Retry 1/" not in log
    export_failures = [line for line in log.splitlines() if "prefect.task_runs 'export-" in line and "Failed(" in line]
    assert len(export_failures) == 1 and "FileExistsError" in export_failures[0], export_failures

    # Longer training with a file where the TensorBoard folder should be: the train stage refuses it with validate's
    # message before any rank starts, once (it would fail again).
    unwritable = mlp_config(tmp_path, mlp_sources, "terminal", train={"num_train_steps": 40, "display_loss_steps": 5},
                            distributed={"num_ranks": 1, "threads_per_rank": 1}, tensorboard={"log_dir": str(blocker)})
    unwritable_file = write_config(unwritable, tmp_path / "bad-events.yaml")
    refused = subprocess.run([ORTFLOW, "run", str(unwritable_file)], env=prefect_server, capture_output=True,
                             text=True, timeout=400, cwd=tmp_path)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1, out[-3000:]
    assert "tensorboard.log_dir: " in out and "not-a-folder is a file, not a folder" in " ".join(out.split()), out
    log = (tmp_path / re.search(r"full log with tracebacks: (\S+)", out)[1]).read_text()
    assert "launching:" not in log and "Retry 1/" not in log, log[-3000:]

    # Training again a run whose final checkpoint exists: the train stage says so and starts no ranks.
    finished = subprocess.run([ORTFLOW, "run", str(config_file), "--from", "train"], env=prefect_server,
                              capture_output=True, text=True, timeout=400, cwd=tmp_path)
    out = finished.stdout + finished.stderr
    assert finished.returncode == 0, out[-3000:]
    words = " ".join(out.split())
    assert "training is already complete at step 20/20" in words and "no ranks started" in words, out
    assert "raise train.num_train_steps" in words and "resuming from" not in out, out
    log = (tmp_path / re.search(r"full log: +(\S+)", out)[1]).read_text()
    assert "launching:" not in log, log[-3000:]
