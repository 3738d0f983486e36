"""``ortflow run``'s terminal: Prefect's log lines go through the CLI's console (the one the progress bar uses, so rich
keeps the bar below them) without tracebacks, and the log file keeps the tracebacks."""

from __future__ import annotations

import io
import logging

from rich.console import Console
from rich.progress import Progress

from ortflow.cli.terminal import terminal


def _task_log(task: str) -> logging.LoggerAdapter:
    """Prefect's logger of a run of the stage task ``task``, as the stage's records carry it."""
    return logging.LoggerAdapter(logging.getLogger("prefect.task_runs"),
                                 {"task_run_name": f"{task}-abc", "task_name": task, "send_to_api": False})


def test_log_lines_share_the_progress_bars_console_and_tracebacks_go_to_the_file(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    logger = _task_log("export")
    with terminal(console, tmp_path / "logs") as log_file, Progress(console=console) as bar:
        task = bar.add_task("training", total=10)
        bar.update(task, completed=3)
        try:
            raise ValueError("export.path: /x/model.onnx is not writable")
        except ValueError:
            logger.exception("Task run failed with exception")
        logger.info("a line after the failure")
    text = out.getvalue()
    assert "Task run failed with exception" in text and "a line after the failure" in text
    assert "Traceback" not in text and "is not writable" not in text.split("Task run failed")[1].split("\n")[0]
    saved = log_file.read_text()
    assert "Traceback (most recent call last)" in saved and "ValueError: export.path" in saved
    # Prefect's handlers get their own console back afterwards.
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    assert handlers and all(h.console is not console for h in handlers)


def test_version_lines_fit_the_width_even_with_long_paths(tmp_path):
    from pathlib import Path

    from ortflow.cli.terminal import version_lines

    base = Path("/" + "/".join(["a-rather-long-folder-name"] * 6))
    entries = [
        {"version": "20261123T031500Z-5f3e2a1b", "policy": "retrain", "steps": "600/600", "final eval loss": 1.23456,
         "best eval loss": 1.2, "exported model": str(base / "versions" / "20261123T031500Z-5f3e2a1b" / "model.onnx")},
        {"version": "20261124T031500Z-0a1b2c3d", "policy": "continue", "parent": "20261123T031500Z-5f3e2a1b",
         "reason": "config, model, data and policy unchanged since version 20261123T031500Z-5f3e2a1b"},
    ]
    lines = version_lines(entries, ["completed", "skipped"], base, width=80)
    assert all(len(line) <= 80 for line in lines), lines
    text = " ".join(" ".join(lines).split())
    assert "eval 1.235 (best 1.2)" in text and "model versions/20261123T031500Z-5f3e2a1b/model.onnx" in text
    assert "skipped: config, model, data and policy unchanged" in text


def test_version_lines_name_the_model_url_of_a_version_on_object_storage(tmp_path):
    from ortflow.cli.terminal import version_lines

    entry = {"version": "20261123T031500Z-5f3e2a1b", "policy": "retrain", "steps": "4/4",
             "exported model": str(tmp_path / "versions" / "20261123T031500Z-5f3e2a1b" / "export" / "model.onnx"),
             "exported model url": "s3://b/runs/versions/20261123T031500Z-5f3e2a1b/export/model.onnx"}
    text = " ".join(version_lines([entry], ["completed"], tmp_path, width=200))
    assert "model s3://b/runs/versions/20261123T031500Z-5f3e2a1b/export/model.onnx" in text


def test_quiet_terminal_shows_warnings_as_short_lines_and_stages_and_the_file_keeps_everything(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=120)
    task_log = _task_log("train")
    with terminal(console, tmp_path / "logs", quiet=True, stages=True) as log_file:
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        task_log.info("[1] 15:54:01 INFO rank 1 parameters sha256 abc at step 100")
        task_log.warning("[0] 15:54:01 WARNING SIGTERM received: stopping after the current weight update")
        task_log.info("Finished in state Completed()")
    lines = out.getvalue().splitlines()
    assert lines[0] == "▸ train"
    assert "warning: [0] SIGTERM received: stopping after the current weight update" in lines
    assert lines[-1].startswith("✓ train (") and len(lines) == 3, lines
    saved = log_file.read_text()
    assert "parameters sha256" in saved and "SIGTERM received" in saved and "Finished in state" in saved


def test_a_stage_stopped_by_a_signal_shows_as_stopped_not_crashed_and_the_file_keeps_prefects_errors(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=120)
    task_log = _task_log("train")
    with terminal(console, tmp_path / "logs", quiet=True, stages=True) as log_file:
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        task_log.warning("[0] 15:54:01 WARNING stop requested: ranks stopped together after step 1001")
        task_log.error("Crash detected! Execution was aborted by an interrupt signal.")
        task_log.error("Finished in state Crashed('Execution was aborted by an interrupt signal.')")
        task_log.error("a real error")
    lines = out.getvalue().splitlines()
    assert lines[0] == "▸ train" and "warning: [0] stop requested: ranks stopped together after step 1001" in lines
    assert lines[2].startswith("■ train stopped by a signal (") and lines[3] == "error: a real error", lines
    assert len(lines) == 4 and not any("Crash" in line for line in lines), lines
    saved = log_file.read_text()
    assert "Crash detected! Execution was aborted by an interrupt signal." in saved and "Crashed(" in saved
    # A crash that no signal caused is shown as crashed (the run's own report then gives its message).
    out = io.StringIO()
    with terminal(Console(file=out, width=120), tmp_path / "logs", quiet=True, stages=True):
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        task_log.error("Finished in state Crashed('Execution was interrupted by an unexpected exception')")
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("✗ train crashed (") and len(lines) == 2, lines


def test_a_failed_stage_shows_its_error_once_and_a_retried_one_says_why_it_runs_again(tmp_path):
    from ortflow.config.base import ConfigError

    out = io.StringIO()
    task_log = _task_log("configure")
    problem = ConfigError("1 problem(s):\n  - distributed.pipeline_parallel_size 16: use 12 or fewer")
    with terminal(Console(file=out, width=120), tmp_path / "logs", quiet=True, stages=True) as log_file:
        logging.getLogger("ortflow.stages").info("stage configure starts", extra={"ortflow_stage": "configure"})
        task_log.error("Error encountered when computing cache key - result will not be persisted.")
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except OSError:  # passes: retried, so its line says why the stage runs again
            task_log.error("Encountered exception during execution: ConnectionResetError(104)", exc_info=True)
        try:
            raise problem
        except ConfigError:  # repeats: not retried; `ortflow run` ends with its message and the fix
            task_log.error(f"Encountered exception during execution: {problem!r}", exc_info=True)
        task_log.error(f"Finished in state Failed('Task run encountered an exception {problem}')")
    lines = out.getvalue().splitlines()
    assert lines[0] == "▸ configure" and lines[1].startswith("error: Encountered exception during execution: "
                                                             "ConnectionResetError"), lines
    assert lines[2].startswith("✗ configure failed (") and len(lines) == 3, lines
    saved = log_file.read_text()
    assert "Encountered exception during execution: ConfigError(" in saved and "Finished in state Failed(" in saved
    assert "computing cache key" in saved


def test_a_resumed_training_names_the_checkpoint_it_resumes_from_once(tmp_path):
    out = io.StringIO()
    task_log = _task_log("train")
    with terminal(Console(file=out, width=120), tmp_path / "logs", quiet=True, stages=True):
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        for rank in (1, 0):
            task_log.info(f"[{rank}] 01:34:31 INFO rank {rank}/2 (local {rank}/2) on cpu with 1 thread(s), starting "
                          "from step 1001 (step-00001001)")
    assert out.getvalue().splitlines() == ["▸ train", "  resuming from step 1001 (step-00001001)"]
    out = io.StringIO()
    with terminal(Console(file=out, width=120), tmp_path / "logs", quiet=True, stages=True):
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        task_log.info("[0] 01:34:31 INFO rank 0/2 (local 0/2) on cpu with 1 thread(s), starting from the initial "
                      "weights")
    assert out.getvalue().splitlines() == ["▸ train"]


def test_the_scheduler_jobs_own_lines_show_in_the_train_stage(tmp_path):
    """A Slurm job's id, why it waits, each allocation and each time-limit requeue show under the train stage, so the
    ranks' stop warnings of a requeue read as what they are; the ranks' info lines stay in the file."""
    out = io.StringIO()
    task_log = _task_log("train")
    job_lines = ["ortflow: slurm job 21", "ortflow: slurm job 21 is pending: PENDING (Resources)",
                 "ortflow: slurm job 21 attempt 0 on node1", "ortflow: the time limit is near: ranks stop after "
                 "this update", "ortflow: ranks exited with status 143", "ortflow: stopped at the time limit (status "
                 "143): requeued; the next allocation resumes from the newest complete checkpoint",
                 "ortflow: slurm job 21 attempt 1 on node1"]  # fmt: skip
    with terminal(Console(file=out, width=200), tmp_path / "logs", quiet=True, stages=True) as log_file:
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        for line in job_lines:
            task_log.info(line)
            task_log.info("[0] 01:34:31 INFO step 10/100 | loss 4.51")
        _task_log("export").info("ortflow: slurm job 9")  # another stage's line: not the train stage's job
    assert out.getvalue().splitlines() == ["▸ train"] + [f"  {line.removeprefix('ortflow: ')}" for line in job_lines]
    assert "step 10/100" in log_file.read_text()
    out = io.StringIO()  # ortflow run -v: the console shows every line already, each once
    with terminal(Console(file=out, width=200), tmp_path / "logs", stages=True):
        logging.getLogger("ortflow.stages").info("stage train starts", extra={"ortflow_stage": "train"})
        task_log.info(job_lines[0])
    assert sum(job_lines[0].removeprefix("ortflow: ") in line for line in out.getvalue().splitlines()) == 1
