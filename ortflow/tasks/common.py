"""What every ortflow task shares: retry policy and forwarding library logs to Prefect's run logger."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from prefect import get_run_logger


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: retry crashes and I/O errors, never a bad config or bad data.

    Every deterministic ortflow error (ConfigError, DataError, ExportError, CheckpointError) is a ValueError; running
    those twice gives the same answer, so the run fails at once with the message that names the fix.
    """
    try:
        state.result()
    except ValueError:
        return False
    except BaseException:  # noqa: BLE001 - anything else may go away on a second try
        return True
    return True


class _RunLoggerHandler(logging.Handler):
    def __init__(self, run_logger: logging.LoggerAdapter):
        super().__init__()
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_logger.log(record.levelno, "%s", record.getMessage())
        except Exception:  # noqa: BLE001 - logging must never fail the stage
            self.handleError(record)


@contextlib.contextmanager
def forward_logs(name: str = "ortflow", level: int = logging.INFO) -> Iterator[logging.LoggerAdapter]:
    """Send the ``ortflow`` library loggers' records to the current task run's logger while the block runs.

    Yields:
        The task run's logger.
    """
    run_logger = get_run_logger()
    library = logging.getLogger(name)
    handler = _RunLoggerHandler(run_logger)
    handler.setLevel(level)
    previous, propagate = library.level, library.propagate
    library.addHandler(handler)
    library.propagate = False  # the run logger already prints each record once
    if library.getEffectiveLevel() > level:
        library.setLevel(level)
    try:
        yield run_logger
    finally:
        library.removeHandler(handler)
        library.setLevel(previous)
        library.propagate = propagate
