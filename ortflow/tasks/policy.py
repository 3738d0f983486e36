"""What every ortflow task shares: retry policy and forwarding library logs to Prefect's run logger."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from typing import Any

from prefect import get_run_logger

#: OSErrors that a second try meets again (a bad or unwritable path), so they are not retried.
_REPEATING_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                     errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL}


def will_repeat(err: BaseException) -> bool:
    """Whether running the same stage again would fail the same way.

    Every deterministic ortflow error (ConfigError, DataError, ExportError, CheckpointError) is a ValueError; a busy
    run folder (RunFolderLocked) is refused at once; path errors (missing, not writable, a file where a folder
    belongs) repeat; a training job whose ranks failed on a config, model or shape error says so (``will_repeat``).
    """
    from ortflow.runlock import RunFolderLocked

    if isinstance(err, ValueError | RunFolderLocked | TypeError):
        return True
    if isinstance(err, OSError) and err.errno in _REPEATING_ERRNOS:
        return True
    return bool(getattr(err, "will_repeat", False))


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: retry crashes and passing I/O errors, never a failure that would repeat (``will_repeat``)."""
    try:
        state.result()
    except BaseException as err:  # noqa: BLE001 - anything else may go away on a second try
        return not will_repeat(err)
    return True


def artifact_key(cfg: Any, kind: str) -> str:
    """Stable artifact key per run name, output folder and kind: ``ortflow-<name>-<8 hex digits>-<kind>``.

    The digits identify the output folder (the base folder of a versioned run, so every version of a deployment
    shares its keys), so two configs that share a ``name`` but not an ``output_dir`` never overwrite each other's
    artifacts.
    """
    import hashlib
    from pathlib import Path

    folder = Path(cfg.output_dir).resolve()
    if folder.parent.name == "versions":  # versions.VERSIONS_DIR: a version folder keys as its base folder
        folder = folder.parent.parent
    slug = "".join(c if c.isalnum() else "-" for c in cfg.name.lower()).strip("-")
    return f"ortflow-{slug}-{hashlib.sha256(str(folder).encode()).hexdigest()[:8]}-{kind}"


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
