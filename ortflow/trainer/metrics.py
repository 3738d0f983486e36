"""What rank 0 reports: TensorBoard events, the progress line, and ``progress.json`` for the orchestrator."""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ortflow.config.atomic import write_text_atomic
from ortflow.trainer.event_records import EventFile, write_record

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("ortflow.trainer")

PROGRESS_FILE = "progress.json"
#: Why a folder takes no files that a retry would meet again: permissions, a read-only mount, a file in the way.
_REPEATS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}


class TensorBoardLog:
    """Scalars and parameter histograms in TensorBoard's event format, filtered by the config's names."""

    def __init__(self, log_dir: Path, scalar_names: tuple[str, ...], histogram_patterns: tuple[str, ...],
                 resumed_from: int | None = None):
        """Args:
            log_dir: The run's TensorBoard folder (a new event file is added to it).
            scalar_names: Scalars to write.
            histogram_patterns: Parameter name patterns to write histograms of.
            resumed_from: The checkpoint step a resumed run starts after: the events earlier attempts wrote for
                later steps are removed, since this run logs those steps again.
        """
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            if resumed_from is not None:
                drop_steps_after(log_dir, resumed_from)
            self._writer = EventFile(log_dir)
        except OSError as err:  # the rank reports a ValueError as one line
            problem = ValueError(f"tensorboard.log_dir: cannot write an event file in {log_dir} "
                                 f"({err.strerror or err}); choose another folder or fix its permissions")
            if err.errno in _REPEATS:  # a refusal: the flow does not retry it
                raise problem from None
            raise problem from err  # with its OSError, a failure a retry may get past (a full disk, a lost server)
        self._scalars = set(scalar_names)
        self._patterns = histogram_patterns

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write the named scalars that the config asks for (None values are skipped)."""
        from tensorboard.compat.proto import summary_pb2

        kept = [
            summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            for tag, value in values.items()
            if tag in self._scalars and value is not None
        ]
        if kept:
            self._emit(step, summary_pb2.Summary(value=kept))

    def histograms(self, step: int, params: Mapping[str, np.ndarray]) -> None:
        """Histograms of the parameters whose names match the config's patterns."""
        if not self._patterns:
            return
        import numpy as np  # the orchestrator reads progress.json through this module: it never loads numpy
        from tensorboard.compat.proto import summary_pb2

        values = []
        for name, array in params.items():
            if any(fnmatch.fnmatchcase(name, p) for p in self._patterns):
                counts, edges = np.histogram(array, bins=30)
                flat = array.reshape(-1)
                histo = summary_pb2.HistogramProto(
                    min=float(flat.min()), max=float(flat.max()), num=float(flat.size), sum=float(flat.sum()),
                    sum_squares=float(np.dot(flat, flat)), bucket_limit=edges[1:].tolist(), bucket=counts.tolist(),
                )
                values.append(summary_pb2.Summary.Value(tag=f"params/{name}", histo=histo))
        if values:
            self._emit(step, summary_pb2.Summary(value=values))

    def _emit(self, step: int, summary) -> None:
        from tensorboard.compat.proto import event_pb2

        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def drop_steps_after(log_dir: Path, step: int) -> int:
    """Remove the summaries of steps after ``step`` from the event files in ``log_dir`` (each file is rewritten
    whole, then renamed over the old one, keeping its name and time); returns how many events were removed."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader  # a resumed run only
    from tensorboard.compat.proto import event_pb2

    removed = 0
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        kept, dropped = [], 0
        for raw in RawEventFileLoader(str(path)).Load():
            event = event_pb2.Event.FromString(raw)
            if event.HasField("summary") and event.step > step:
                dropped += 1
            else:
                kept.append(raw)
        if not dropped:
            continue
        times = path.stat()
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as f:
            for raw in kept:
                write_record(f, raw)
            f.flush()
            os.fsync(f.fileno())
        os.utime(tmp, ns=(times.st_atime_ns, times.st_mtime_ns))
        os.replace(tmp, path)
        removed += dropped
    return removed


def format_duration(seconds: float) -> str:
    """``3h04m``, ``4m12s`` or ``9s``."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """The rank-0 progress line with ETA, and ``progress.json`` (written atomically) for whoever watches the run."""

    def __init__(self, run_dir: Path, total: int, first_step: int, clock: Callable[[], float] = time.monotonic):
        self.path = run_dir / PROGRESS_FILE
        self.total = total
        self.first_step = first_step
        self.clock = clock
        self.started = clock()

    def eta(self, step: int) -> float | None:
        """Seconds left, from the mean time per update since this process started."""
        done = step - self.first_step
        if done <= 0:
            return None
        return (self.clock() - self.started) / done * (self.total - step)

    def report(self, step: int, fields: Mapping[str, float | int | str | None], final: bool = False) -> None:
        """Log the progress line and rewrite progress.json."""
        eta = self.eta(step)
        parts = [f"step {step}/{self.total}"]
        for key, value in fields.items():
            if value is None:
                continue
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        if eta is not None and not final:
            parts.append(f"eta {format_duration(eta)}")
        log.info(" | ".join(parts))
        record = {"step": step, "total": self.total, "eta_s": eta, "final": final, "time": time.time(), **fields}
        write_text_atomic(self.path, json.dumps(record))


def read_progress(run_dir: Path) -> dict | None:
    """The last progress record of a run, or None before the first."""
    try:
        return json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
