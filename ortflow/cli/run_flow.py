"""What ``ortflow run`` does: the whole pipeline as a Prefect flow in this terminal, with a line per stage, a progress
bar, the summary and what to do next."""

from __future__ import annotations

import contextlib
import functools
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ortflow.checkpoints import list_complete
from ortflow.cli.shared import console, fail, load, say
from ortflow.cli.stop_signals import STOP_SIGNALS, SayOnce, hand_back
from ortflow.cli.terminal import disk_problem, failure_advice, follow_progress, next_steps, terminal
from ortflow.config import RunConfig
from ortflow.versions import EXPORTED_LOCAL_COPY, read_registry


def run_in_terminal(config: Path, overrides: list[str] | None, from_stage: str | None, new_version: bool,
                    policy: str | None, skip_unchanged: bool | None, wait: bool, version: str | None,
                    verbose: bool) -> None:
    """``ortflow run`` with its options (see its help): load the config, run the flow, report the outcome."""
    cfg = load(config, overrides)
    # A line at once: importing Prefect and starting its server take a while on a busy machine.
    say(f"ortflow run {cfg.name}: {_what_runs(new_version, from_stage, version)}{cfg.output_dir}")
    command = shlex.join(["ortflow", "run", *sys.argv[sys.argv.index("run") + 1:]] if "run" in sys.argv
                         else ["ortflow", "run", str(config)])
    _refuse_if_busy(cfg, wait, command)
    # Prefect takes seconds to import: imported once that line is out, and before terminal() below, because importing
    # it sets up Prefect's logging, which terminal() then routes through this console.
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    from ortflow.flows import train_pipeline

    _check_options(from_stage, policy, version, new_version)
    history = None if PREFECT_API_URL.value() else Path(PREFECT_HOME.value())  # the temporary server's database
    flow = functools.partial(train_pipeline, cfg, from_stage=from_stage, policy=policy, skip_unchanged=skip_unchanged,
                             new_version=new_version, wait_for_lock=wait or None, version=version, return_state=True)
    with _stop_signals() as signals:
        with terminal(console, cfg.output_dir / "logs", quiet=not verbose, stages=True) as log_file:
            state = _run_flow(cfg, flow, signals.received)
        signals.flow_ended = True
        _upload_log(cfg, log_file, warn=state is not None and state.is_completed())
        if signals.received:
            _say_stopped(cfg, new_version, signals.received[0], log_file, command)
        if not state.is_completed():
            _report_failure(state, command, log_file)
        if state.name == "Skipped":
            console.print(f"[yellow]{escape(state.message or 'skipped')}[/]; nothing was trained", highlight=False)
            return
        _report_summary(cfg, state.result(), new_version, log_file, history)


def _what_runs(new_version: bool, from_stage: str | None, version: str | None) -> str:
    """The headline's words before the run folder: a versioned ``--from`` reruns stages of an existing version."""
    if not new_version:
        return ""
    if from_stage is None:
        return "a new version in "
    return f"rerunning {from_stage} onwards in {f'version {version}' if version else 'the newest version'} of "


def _upload_log(cfg: RunConfig, log_file: Path, warn: bool) -> None:
    """A run folder on object storage gets the whole log, the lines after its last stage included. Only a run that
    completed warns when that fails: a failed or stopped run's report names the local log (and the store's problem)."""
    from ortflow.checkpoints.run_store import push_log

    problem = push_log(cfg, log_file)
    if problem and warn:
        console.print(f"warning: the log stays in {log_file} only: {problem}", highlight=False, markup=False,
                      style="yellow")


def _refuse_if_busy(cfg: RunConfig, wait: bool, command: str) -> None:
    """A run folder that another live process writes is refused before Prefect is imported (the flow's own lock
    still settles two runs that start together); exit 1."""
    from ortflow.runlock import RunFolderLocked, holder

    if wait or cfg.pipeline.wait_for_lock:
        return
    try:
        busy = holder(cfg.output_dir)
    except OSError:  # not a readable folder: the pipeline's first stage says what is wrong with it
        return
    if busy is None:
        return
    err = RunFolderLocked(cfg.output_dir, busy)
    console.print(f"error: pipeline refused: {err}", highlight=False, markup=False, style="bold red")
    for line in failure_advice(err, command):
        say(f"  {line}")
    raise typer.Exit(1)


def _check_options(from_stage: str | None, policy: str | None, version: str | None, new_version: bool) -> None:
    from ortflow.tasks.caching import STAGES

    if from_stage is not None and from_stage not in STAGES:
        fail(f"--from {from_stage}: unknown stage; use one of {', '.join(STAGES)}")
    if policy is not None and policy not in ("retrain", "continue"):
        fail(f"--policy {policy}: use retrain or continue")
    if version is not None and not (new_version and from_stage):
        fail("--version names the version whose stages --from reruns: use it with --new-version --from STAGE")


class _FlowSignals:
    """``ortflow run``'s SIGINT/SIGTERM: :attr:`received` collects the signals that stopped the flow run."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.flow_ended = False  # the flow run has its final state: the exit status is decided
        self._say_once = SayOnce()

    def handle(self, signum: int, _frame: object) -> None:
        # The first SIGINT/SIGTERM unwinds like Ctrl-C: the train task's launcher stops the ranks with a stop
        # checkpoint and the flow run records its final state. A repeat (a second Ctrl-C, or the same signal sent
        # to the whole process group) must not cut that stop short, nor a signal once the flow run has ended.
        name = signal.Signals(signum).name
        if self.flow_ended:
            self._say_once(f"{name}: the flow run has ended; ortflow run is exiting")
        elif self.received:
            self._say_once(f"already stopping ({signal.Signals(self.received[0]).name}): the ranks are writing "
                           "their stop checkpoint")
        else:
            self.received.append(signum)
            raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_signals() -> Iterator[_FlowSignals]:
    """Handle SIGINT/SIGTERM until the command ends, then hand them back (the ``ortflow`` process ignores them until
    it exits: a late repeat of the stop signal must not kill it while it reports)."""
    signals = _FlowSignals()
    previous = {sig: signal.signal(sig, signals.handle) for sig in STOP_SIGNALS}
    try:
        yield signals
    finally:
        signals.flow_ended = True
        hand_back(previous)


def _run_flow(cfg: RunConfig, flow: Callable, received: list[int]):
    """The flow run's final state (None when a signal stopped it), on a temporary server if none is configured."""
    from ortflow.deployments.local_server import api_server
    from ortflow.tasks import crash_vanished_runs

    stop = threading.Event()
    watcher = threading.Thread(target=follow_progress, args=(console, lambda: _newest_run_dir(cfg), stop),
                               daemon=True)
    state = None
    try:
        # No PREFECT_API_URL: a temporary server in a session of its own (Ctrl-C to this terminal's process
        # group never reaches it), stopped once the flow run has its final state.
        with api_server(say=say):
            for name in crash_vanished_runs():  # runs of this host whose process is gone (a kill -9)
                say(f"flow run {name} was still Running, but its process is gone: marked Crashed")
            watcher.start()
            try:
                # The flow runs in this (main) thread: Prefect's task timeouts need it, and Ctrl-C reaches the
                # launcher, which stops the ranks' process group.
                state = flow()
            finally:
                stop.set()
                watcher.join(timeout=5)
    except KeyboardInterrupt:
        received.append(received[0] if received else signal.SIGINT)
    except RuntimeError as err:  # the temporary server did not start
        if state is None and not received:
            fail(str(err))
        raise
    return state


def _say_stopped(cfg: RunConfig, new_version: bool, signum: int, log_file: Path, command: str) -> None:
    """Report where a stopped run left its work and how to go on; exit 128 + the signal."""
    console.print(f"[yellow]stopped by {signal.Signals(signum).name}[/]: {escape(_stop_record(cfg, new_version))}; "
                  f"the log is in {escape(str(log_file))}", highlight=False)
    how = "to train a new version" if new_version else "to resume from the newest checkpoint"
    console.print(f"  {how}: {escape(command)}", highlight=False)
    raise typer.Exit(128 + signum)


def _report_failure(state, command: str, log_file: Path) -> None:
    """The failed stage's own message, what to do about it and where the full log is; exit 1."""
    try:
        state.result()
    except BaseException as err:  # noqa: BLE001 - the stage's own failure, shown without a traceback
        console.print(f"error: pipeline {state.name.lower()}: {disk_problem(err) or err}", highlight=False,
                      markup=False, style="bold red")
        for line in failure_advice(err, command):
            say(f"  {line}")
        say(f"  full log with tracebacks: {log_file}")
        raise typer.Exit(1) from None
    fail(f"pipeline ended in state {state.name}")


def _report_summary(cfg: RunConfig, summary: dict, new_version: bool, log_file: Path, history: Path | None) -> None:
    """The run's summary as a table, then what to do next (TensorBoard, sampling, the log, the run history)."""
    table = Table(title=f"ortflow run {cfg.name}", show_header=False)
    for key, value in summary.items():
        table.add_row(key, "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    # The local file (a run folder on the store: the summary's "exported model" is the URL, its local copy a row)
    local = summary.get(EXPORTED_LOCAL_COPY) or summary.get("exported model")
    exported = Path(local) if local else None
    run_dir = cfg.output_dir
    if new_version:  # the version's own folder (the registry's newest entry)
        with contextlib.suppress(ValueError, IndexError, KeyError):
            run_dir = Path([e for e in read_registry(cfg.output_dir) if e.get("path")][-1]["path"])
    events = cfg.tensorboard.log_dir or run_dir / "tensorboard"
    for line in next_steps(events, exported, cfg.data.format == "text", log_file, history):
        say(line)


def _stop_record(cfg: RunConfig, new_version: bool) -> str:
    """Where a stopped run left its work: the version and its newest complete (stop) checkpoint."""
    folder, version = cfg.output_dir, None
    if new_version:
        try:
            entries = [e for e in read_registry(cfg.output_dir) if e.get("path")]
        except ValueError:
            entries = []
        if entries:
            folder, version = Path(entries[-1]["path"]), entries[-1]["version"]
    done = list_complete(folder / "checkpoints")
    where = f"version {version}, " if version else ""
    return f"{where}newest checkpoint {done[-1].path}" if done else f"{where}no checkpoint was written yet"


def _newest_run_dir(cfg: RunConfig) -> Path:
    """The folder the progress bar watches: the running version's, once plan_version registered it."""
    try:
        running = [e for e in read_registry(cfg.output_dir) if e.get("status") == "running" and e.get("path")]
    except ValueError:
        running = []
    return Path(running[-1]["path"]) if running else cfg.output_dir
