"""``ortflow run`` in a terminal: the pipeline's stages as short lines, a progress bar (compact progress lines when
the output is not a terminal), warnings and errors; every record, tracebacks and the ranks' lines included, goes to a
log file. Prefect's log lines and the progress bar share one console (the bar stays on its own line below the logs),
and a failed stage is reported as its own message plus the command that reruns or fixes it."""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shlex
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ortflow.runlock import RunFolderLocked

#: Loggers of HTTP libraries, kept at WARNING in the terminal and the run's log file.
QUIET_LOGGERS = ("httpx", "httpcore")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(run_name)s| %(message)s"


class _FileFormatter(logging.Formatter):
    """The log file's lines name the task or flow run (Prefect puts the names on its run loggers' records)."""

    def format(self, record: logging.LogRecord) -> str:
        name = getattr(record, "task_run_name", None) or getattr(record, "flow_run_name", None)
        record.run_name = f"'{name}' " if name else ""
        return super().format(record)


class _NoTraceback(logging.Formatter):
    """Formats a record without its exception text (the log file keeps it); the record itself is left untouched."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            text = self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        return text.split("\nTraceback (most recent call last)")[0]


class _Short(logging.Formatter):
    """A warning or error as one short line: ``warning: [0] SIGTERM received: ...`` (a rank's line keeps its rank
    tag, not its own time and level)."""

    _RANK_HEAD = re.compile(r"^(\[\d+\]) \d\d:\d\d:\d\d [A-Z]+ ")

    def format(self, record: logging.LogRecord) -> str:
        message = self._RANK_HEAD.sub(r"\1 ", record.getMessage())
        return f"{record.levelname.lower()}: {message}"


def _console_handlers() -> list[logging.Handler]:
    # Prefect (and the tasks package, which imports it) take seconds to import: imported when a run starts, so that
    # the commands that do not run a flow, and `ortflow --help`, start at once.
    from prefect.logging.configuration import setup_logging
    from prefect.logging.handlers import PrefectConsoleHandler

    def found() -> list[logging.Handler]:
        loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                          if isinstance(lg, logging.Logger))]
        return [h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)]

    return found() or (setup_logging(), found())[1]


#: How ``ortflow run`` names the stage tasks in its short stage lines.
STAGE_LABELS = {"configure": "configure", "prepare_data": "prepare data", "train": "train",
                "retain_checkpoints": "keep checkpoints", "export": "export"}
_FINISHED = re.compile(r"Finished in state (\w+)")
#: Prefect's words for a run it ends Crashed because a signal stopped it: after a Ctrl-C or SIGTERM the ranks stop
#: with a checkpoint and `ortflow run` says so, so the terminal shows the stage as stopped, not crashed.
_SIGNALLED = ("aborted by an interrupt signal", "aborted by a termination signal")
#: How the lines of a scheduler job's life start (its id, why it is pending, each allocation, a time-limit requeue),
#: from the watcher (ortflow/launch/job.py) and the job script (ortflow/launch/slurm.py).
_JOB_LINE = "ortflow: "
#: Rank 0's first line (ortflow/trainer/parallel/build.py) when it resumes from a checkpoint.
_RESUMED = re.compile(r"^\[0\] \S+ INFO rank 0/\d+ .*, starting from (step \d+ \(.+\))$")


class _NoEcho(logging.Filter):
    """Drops Prefect's errors that ``ortflow run`` says better from the terminal (the log file keeps them):
    ``Crash detected! Execution was aborted by an interrupt signal.`` of a signalled run (it says where the run
    stopped), a stage's final ``Finished in state Failed(...)`` or ``Crashed(...)`` (its stage line says failed, and the
    run ends with the stage's own message and the fix), and ``Encountered exception during execution: ...`` for an
    error that a retry would meet again (so none follows: that final message shows it). A passing error's line stays:
    it says why the stage runs again. Also ``Error encountered when computing cache key``: an input the key hashes
    is missing or unreadable, which the stage then reports itself (its result is not cached)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        if any(words in message for words in _SIGNALLED):
            return False
        if not record.name.startswith("prefect"):
            return True
        if re.match(r"Finished in state (Failed|Crashed)\(", message):
            return False
        if message.startswith("Error encountered when computing cache key"):  # a missing input: the stage says so
            return False
        if message.startswith("Encountered exception during execution") and record.exc_info:
            from ortflow.tasks.policy import will_repeat

            return not will_repeat(record.exc_info[1])
        return True


class StageLines(logging.Handler):
    """Prints a line when a stage starts (``ortflow.stages``' records) and when Prefect reports its task finished:
    ``▸ configure``, then ``✓ configure (4 s)``, ``✓ prepare data (unchanged)`` or ``✗ train failed (12 s)``; when
    training resumes, the checkpoint it resumes from (``  resuming from step 1001 (step-00001001)``); and the lines of
    a scheduler job's life (``  slurm job 42 is pending: PENDING (Resources)``, ``  slurm job 42 attempt 1 on
    node1``)."""

    def __init__(self, console: Console, job_lines: bool = True):
        super().__init__(logging.INFO)
        self.console = console
        self.job_lines = job_lines  # False where the console shows every INFO line already (ortflow run -v)
        self.started: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        stage = getattr(record, "ortflow_stage", None)
        if stage in STAGE_LABELS:
            self.started[stage] = time.monotonic()
            self._say(f"▸ {STAGE_LABELS[stage]}")
            return
        name = getattr(record, "task_run_name", None) or ""
        stage = getattr(record, "task_name", None) or name.rpartition("-")[0]
        resumed = _RESUMED.match(record.getMessage()) if stage == "train" else None
        if resumed:  # the progress bar starts past 0: say where from
            self._say(f"  resuming from {resumed[1]}")
            return
        if (self.job_lines and stage == "train" and record.levelno == logging.INFO
                and record.getMessage().startswith(_JOB_LINE)):
            self._say(f"  {record.getMessage().removeprefix(_JOB_LINE)}")  # the scheduler job's own line
            return
        found = _FINISHED.match(record.getMessage()) if stage in self.started else None
        if found is None:
            return
        state, label = found[1], STAGE_LABELS[stage]
        if state in ("AwaitingRetry", "Retrying"):  # the same stage runs again; its finish comes later
            return
        took = time.monotonic() - self.started.pop(stage)
        if state == "Cached":
            self._say(f"✓ {label} (unchanged)")
        elif state == "Completed":
            self._say(f"✓ {label} ({format_seconds(took)})")
        elif state == "Crashed" and any(words in record.getMessage() for words in _SIGNALLED):
            self._say(f"■ {label} stopped by a signal ({format_seconds(took)})")
        else:
            self._say(f"✗ {label} {state.lower()} ({format_seconds(took)})")

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False)


def format_seconds(seconds: float) -> str:
    """``4s``, ``3m20s``."""
    from ortflow.tasks.training import format_duration

    return format_duration(seconds)


def follow_progress(console: Console, run_dir, stop) -> None:
    """Show the run's ``progress.json`` until ``stop`` (a threading.Event) is set: a rich progress bar (loss, eval
    loss, ETA) when ``console`` is a terminal, else a compact line per new record (every display period).

    ``run_dir`` is the folder, or a function returning it (a new version's folder appears once the run has begun).
    """
    from ortflow.tasks.training import progress_line, read_progress

    folder = run_dir if callable(run_dir) else (lambda: run_dir)
    start = read_progress(folder())
    seen = start.get("time") if start else None

    def records() -> Iterator[dict]:
        nonlocal seen
        while not stop.wait(0.5):
            record = read_progress(folder())
            if record is None or record.get("time") == seen:  # a record left by an earlier run is not this run's
                continue
            seen = record.get("time")
            yield record
            if record.get("final"):  # training ended: the bar stops here, the next stage lines go below it
                return

    if not console.is_terminal:
        for record in records():
            console.print(progress_line(record)[:120], highlight=False, markup=False)
        return
    columns = (TextColumn("  train"), BarColumn(bar_width=30), MofNCompleteColumn(), TextColumn("{task.description}"))
    # The same console as the log lines (terminal()): rich keeps the bar on its own line below them.
    with Progress(*columns, console=console, transient=False) as bar:
        task_id = None
        for record in records():
            total = record.get("total") or 1
            if task_id is None:
                task_id = bar.add_task("", total=total)
            text = progress_line(record).partition(" · ")[2]
            bar.update(task_id, completed=record.get("step", 0), total=total, description=text)


def next_steps(tensorboard_dir: Path, export_path: Path | None, text_model: bool, log_file: Path,
               prefect_home: Path | None) -> list[str]:
    """What to do after a completed ``ortflow run``: the lines printed under its summary.

    Args:
        tensorboard_dir: The run's TensorBoard event folder.
        export_path: The exported model (None: nothing exported).
        text_model: The model reads bytes of text (``data.format: text``): ``ortflow sample`` can continue a prompt.
        log_file: This run's log file.
        prefect_home: The folder holding the temporary Prefect server's run history (None: a configured server).
    """
    def short(path: Path) -> str:
        with contextlib.suppress(ValueError):
            return str(Path(path).resolve().relative_to(Path.cwd()))
        return str(path)

    lines = ["next steps:", f"  loss curves:     tensorboard --logdir {shlex.quote(short(tensorboard_dir))}"]
    if export_path is not None and text_model:
        lines.append(f"  generate text:   ortflow sample {shlex.quote(short(export_path))} --prompt 'def '")
    lines.append("  your own model:  docs/your-model.md (export it from PyTorch, point a config at it)")
    lines.append(f"  full log:        {short(log_file)}")
    if prefect_home is not None:
        lines.append(f"  run history:     PREFECT_HOME={shlex.quote(short(prefect_home))} prefect server start")
    return lines


@contextlib.contextmanager
def terminal(console: Console, log_dir: Path, quiet: bool = False, stages: bool = False) -> Iterator[Path]:
    """Route Prefect's console logging through ``console`` without tracebacks, and every record (tracebacks
    included) into a new log file under ``log_dir``.

    Args:
        console: Where log lines, stage lines and the progress bar go.
        log_dir: The run's log folder.
        quiet: Only warnings and errors of the loggers reach ``console`` (Prefect's state lines, the ranks' lines and
            the engine's are in the log file).
        stages: Print a short line as each stage starts and ends (:class:`StageLines`).

    Yields:
        The log file's path.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / time.strftime("run-%Y%m%dT%H%M%SZ.log", time.gmtime())
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(_FileFormatter(LOG_FORMAT))
    file_handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    handlers = _console_handlers()
    saved = [(h, h.console, h.formatter, h.level) for h in handlers]
    no_echo = _NoEcho()
    for handler in handlers:
        handler.console = console  # one console: rich prints log lines above the live progress bar
        handler.setFormatter(_NoTraceback(_Short() if quiet else handler.formatter))
        if quiet:
            handler.setLevel(max(handler.level, logging.WARNING))
            handler.addFilter(no_echo)
    added = [file_handler, *([StageLines(console, job_lines=quiet)] if stages else [])]
    for handler in added:
        root.addHandler(handler)
    previous_level = root.level
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    # Prefect's client logs one INFO line per API request (a progress update each second): not the user's business.
    quiet_loggers = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield path
    finally:
        for name, level in quiet_loggers.items():
            logging.getLogger(name).setLevel(level)
        for handler in added:
            root.removeHandler(handler)
        root.setLevel(previous_level)
        file_handler.close()
        for handler, old_console, formatter, level in saved:
            handler.console = old_console
            handler.setFormatter(formatter)
            handler.setLevel(level)
            handler.removeFilter(no_echo)


#: errno values that say the disk, not the input, is the problem: the user frees space or fixes permissions.
_DISK_ERRORS = {
    errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded", errno.EROFS: "it is read-only",
    errno.EACCES: "permission is denied", errno.EPERM: "permission is denied",
}


def disk_problem(err: BaseException, where: Path | str | None = None) -> str | None:
    """A one-line message for a full, read-only or forbidden path (naming the path and the fix), else None.

    Args:
        err: The error (an OSError, or one raised from it).
        where: The folder the command was writing, named when the error does not carry a file name (a full disk
            fails a ``write``, which has none).
    """
    while err is not None and not isinstance(err, OSError):
        err = err.__cause__ or err.__context__
    if err is None or err.errno not in _DISK_ERRORS:
        return None
    target = err.filename or where
    where = f" {target}" if target else ""
    fix = ("free disk space there (or point output_dir / checkpoint.dir / export.path elsewhere)"
           if err.errno in (errno.ENOSPC, errno.EDQUOT)
           else "make it writable (or point output_dir / checkpoint.dir / export.path at a writable folder)")
    return f"cannot write{where}: {_DISK_ERRORS[err.errno]}; {fix}, then rerun the command"


def failure_advice(err: BaseException, command: str) -> list[str]:
    """What to do after a failed ``ortflow run``: fix-then-rerun for errors that would repeat, else rerun."""
    from ortflow.tasks.policy import will_repeat

    if isinstance(err, RunFolderLocked):
        return [f"to queue behind it instead: {command} --wait"]
    if will_repeat(err):
        return [f"fix the problem above, then: {command}"]
    return [f"to retry (finished stages are skipped, training resumes from its newest checkpoint): {command}"]


def version_lines(entries: list[dict], statuses: list[str], base: Path, width: int = 80) -> list[str]:
    """``ortflow runs`` as lines of at most ``width`` columns (a path longer than a line continues on the next): the
    folder, then per version ``name status policy steps`` and indented lines of losses, parent, skip reason, model.

    Args:
        entries: Registry entries, oldest first.
        statuses: The status to show for each (``describe``: ``interrupted`` for an abandoned ``running``).
        base: The output_dir, so that paths inside it print relative to it.
        width: Columns to fit.
    """
    def num(value: object) -> str:
        return f"{value:.4g}" if isinstance(value, float) else "-" if value is None else str(value)

    def short(path: object) -> str:
        try:
            return str(Path(str(path)).relative_to(base))
        except ValueError:
            return str(path)

    lines = textwrap.wrap(f"versions in {base}", width, subsequent_indent="  ", break_long_words=True)
    for entry, status in zip(entries, statuses, strict=True):
        head = f"{entry['version']}  {status:<11} {entry.get('policy') or '-':<8} steps {num(entry.get('steps'))}"
        details = [f"eval {num(entry.get('final eval loss'))} (best {num(entry.get('best eval loss'))})"]
        if entry.get("parent"):
            details.append(f"parent {entry['parent']}")
        if status == "skipped" and entry.get("reason"):
            details.append(f"skipped: {entry['reason']}")
        if entry.get("exported model url") or entry.get("exported model"):  # a run folder on the store: the URL
            details.append(f"model {entry.get('exported model url') or short(entry['exported model'])}")
        lines.append(head[:width])
        lines += textwrap.wrap("; ".join(details), width, initial_indent="  ", subsequent_indent="    ",
                               break_long_words=True, break_on_hyphens=False)
    return lines
