"""What a flow run that Prefect started in a process of its own prints in its terminal (``ortflow serve``'s, a
``prefect worker``'s): Prefect's lines without tracebacks, and a failed run as one line naming the run, the stage that
failed, its error and where the full log is.

``ortflow serve``'s flow runs are processes of their own (``python -m prefect.engine``) that set up Prefect's logging
from ``PREFECT_LOGGING_SETTINGS_PATH``; :func:`write_logging_config` writes Prefect's own logging config with the
console handler's formatter and filter replaced by the two classes below. A worker's flow runs (``prefect worker
start``, whose environment ortflow does not set) get the same two from :func:`quiet_console`, which the flows' first
hook calls as the run starts. Only the console changes: the run's logs on the Prefect server (its UI, ``prefect
flow-run logs ID``) keep every record with its traceback.

Each flow-run process imports this module while it sets up logging: it imports only what Prefect has loaded.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

#: Prefect's errors that the one line replaces (each carries the same exception, with a traceback).
_REPLACED = re.compile(r"^(Task run failed with |Encountered exception during execution|"
                       r"Engine execution exited with unexpected exception|Crash detected!)")
_RETRY = re.compile(r" - Retry \d+/\d+ will start")
_ENDED = re.compile(r"^Finished in state (Failed|Crashed|TimedOut)\(")
#: Prefect's words for a run that a stop signal ended (serve's SIGTERM or Ctrl-C): stopped, not failed.
_SIGNALLED = ("aborted by an interrupt signal", "aborted by a termination signal")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


class ServedRunFailures(logging.Filter):
    """The console filter of a served flow run: drops Prefect's error records that repeat the failure (the task's,
    the flow's and the engine's, each with a traceback), remembers the first failed stage and its error, and marks
    the flow run's final ``Finished in state Failed(...)`` record with the one line :class:`NoTraceback` prints
    instead. A retried stage's error stays (one line, no traceback): it says why the stage runs again."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: str | None = None
        self.error: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and not _RETRY.search(message) and _REPLACED.match(message):
            err = record.exc_info[1] if record.exc_info else None
            if self.error is None and err is not None:  # the first failure is the cause; the flow's repeats it
                self.stage = getattr(record, "task_name", None)
                self.error = f"{type(err).__name__}: {err}"
            return False
        if record.name.startswith("prefect.task_runs") and _ENDED.match(message):
            return False  # the failed stage's final state: the run's line says it
        ended = _ENDED.match(message)
        if ended and record.name.startswith("prefect.flow_runs"):
            record.ortflow_line = self.line(record, ended.group(1).lower(), message)
        return True

    def line(self, record: logging.LogRecord, outcome: str, message: str) -> str:
        """``error: flow run NAME (FLOW/DEPLOYMENT) failed in STAGE: ERROR; full log with tracebacks: prefect
        flow-run logs ID (or the Prefect UI)``; a run a stop signal ended is ``stopped by a signal``, not an error."""
        flow = getattr(record, "flow_name", "?")
        deployment = getattr(record, "deployment_name", None)
        which = f"{flow}/{deployment}" if deployment else flow
        state_message = re.sub(r"^Finished in state \w+\('?|'?\)$", "", message)
        if any(words in message for words in _SIGNALLED):
            head, error = "", f"stopped by a signal: {state_message}"
        else:
            where = f" in {self.stage}" if self.stage else ""
            head, error = "error: ", f"{outcome}{where}: {self.error or state_message}"
        return (f"{head}flow run {getattr(record, 'flow_run_name', '?')} ({which}) {_one_line(error)}; full log with "
                f"tracebacks: prefect flow-run logs {getattr(record, 'flow_run_id', '?')} (or the Prefect UI)")


class NoTraceback(logging.Formatter):
    """Prefect's console format without exception text or stack, and a record marked by :class:`ServedRunFailures`
    as its one line (the record itself is left untouched for the other handlers)."""

    def __init__(self, *args: object, inner: logging.Formatter | None = None, **kwargs: object):
        super().__init__()
        from prefect.logging.formatters import PrefectFormatter

        self.inner = inner if inner is not None else PrefectFormatter(*args, **kwargs)

    def format(self, record: logging.LogRecord) -> str:
        line = getattr(record, "ortflow_line", None)
        if line is not None:
            return line
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record).split("\nTraceback (most recent call last)")[0]
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def write_logging_config(path: Path) -> Path:
    """Write Prefect's logging config (its ``logging.yml``) with the console handler's formatter and filter made the
    ones above to ``path``; returns ``path`` (for ``PREFECT_LOGGING_SETTINGS_PATH``)."""
    import yaml
    from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH

    # Loaded raw: Prefect fills in its `${SETTING}` templates when each process reads the file.
    config = yaml.safe_load(DEFAULT_LOGGING_SETTINGS_PATH.read_text())
    standard = dict(config["formatters"]["standard"])
    standard.pop("()", None)
    config["formatters"]["ortflow_served"] = {"()": f"{__name__}.NoTraceback", **standard}
    config.setdefault("filters", {})["ortflow_served"] = {"()": f"{__name__}.ServedRunFailures"}
    console = config["handlers"]["console"]
    console["formatter"] = "ortflow_served"
    console["filters"] = ["ortflow_served"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def quiet_console(env: Mapping[str, str] = os.environ) -> bool:
    """In a flow-run process that Prefect started (``PREFECT__FLOW_RUN_ID`` set: a worker's or a runner's), give
    Prefect's console handler on the root logger :class:`NoTraceback` around its own formatter and the
    :class:`ServedRunFailures` filter, once; returns whether it did. A flow called in this process (``ortflow run``)
    keeps its terminal's own handling."""
    if not env.get("PREFECT__FLOW_RUN_ID"):
        return False
    from prefect.logging.handlers import PrefectConsoleHandler

    done = False
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, PrefectConsoleHandler):
            continue
        if not any(isinstance(f, ServedRunFailures) for f in handler.filters):
            handler.addFilter(ServedRunFailures())
        if not isinstance(handler.formatter, NoTraceback):
            handler.setFormatter(NoTraceback(inner=handler.formatter or logging.Formatter()))
        done = True
    return done
