"""``ortflow run``'s terminal: Prefect's log lines go through the CLI's console (the one the progress bar uses, so rich
keeps the bar below them) without tracebacks, and the log file keeps the tracebacks."""

from __future__ import annotations

import io
import logging

from rich.console import Console
from rich.progress import Progress

from ortflow.cli_terminal import terminal


def test_log_lines_share_the_progress_bars_console_and_tracebacks_go_to_the_file(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    logger = logging.LoggerAdapter(logging.getLogger("prefect.task_runs"),
                                   {"task_run_name": "export-abc", "task_name": "export", "send_to_api": False})
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
