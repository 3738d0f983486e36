"""SIGINT/SIGTERM for the whole life of ``ortflow train``: a stop signal, once or repeated, always ends the command
with its documented status (130/143), never by the signal itself.

Before the job starts a signal ends the command at once (nothing is running; exit 128 + the signal). While the job
runs the launcher's watcher owns the signals (:func:`ortflow.launch.job.watch`: the ranks stop with a stop
checkpoint); a signal that comes between the two is kept, and the watcher stops the job as soon as it starts. Once
the job has ended a signal is noted and ignored: the exit status is decided. When the command is the process itself
(``ortflow`` run from a shell, :func:`mark_process_entry`) the signals stay ignored until the process exits, since
the interpreter gives them back their default action (death by the signal) while it shuts down.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from ortflow.cli.shared import say

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_process_entry: list[bool] = [False]


def mark_process_entry() -> None:
    """This process is the ``ortflow`` command: nothing runs after it but the interpreter's shutdown."""
    _process_entry[0] = True


class StoppedBeforeJob(BaseException):  # noqa: N818 (not an error: a request, unwound like KeyboardInterrupt)
    """A stop signal came before the training job started."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class SayOnce:
    """Says each line once: a process manager may repeat a signal many times."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def __call__(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            say(line)


class StopSignals:
    """The command's stop signals: :attr:`received` collects them, in order."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.phase = "before"  # "job" once the job is being started, "after" once it has ended
        self._say_once = SayOnce()

    def handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.phase == "before":
            raise StoppedBeforeJob(signum)
        if self.phase == "after":
            self._say_once(f"{name}: the training job has ended; the command is exiting")
            return
        if self.received:
            self._say_once(f"{name} again: already stopping; the command exits once the ranks have stopped")
        self.received.append(signum)  # before the watcher took over: it stops the job as soon as it starts


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """Own SIGINT/SIGTERM from now to the end of the command (see the module's docstring).

    Set :attr:`StopSignals.phase` to ``"job"`` right before starting the job (pass :attr:`StopSignals.received` to
    the watcher) and to ``"after"`` once it has ended; it is ``"after"`` on leaving in any case.
    """
    stops = StopSignals()
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's (called as a
        stops.phase = "job"  # function from another thread: the signals stay with whoever owns them)
        yield stops
        return
    previous = {sig: signal.signal(sig, stops.handle) for sig in STOP_SIGNALS}
    try:
        yield stops
    finally:
        stops.phase = "after"
        hand_back(previous)


def hand_back(previous: dict[int, object]) -> None:
    """The command is ending: the ``ortflow`` process ignores the stop signals until it exits (a signal now must not
    decide its status, and the interpreter's shutdown would give them their default action); a command called as a
    function gives back the ``previous`` handlers."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN if _process_entry[0] else previous[sig])
