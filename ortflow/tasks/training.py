"""The train task: run the mpiexec job, forward its output, keep a Prefect progress artifact up to date."""

from __future__ import annotations

import contextvars
import datetime
import logging
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from ortflow import runlock
from ortflow.checkpoints import completed_run, list_complete
from ortflow.checkpoints.layout_check import resume_layout_refusal
from ortflow.config import RESOLVED_CONFIG_NAME, RunConfig, dump_config, write_resolved_config
from ortflow.launch.guard import GUARD_LOG, JobGuard, taken_over_lines
from ortflow.launch.job import STOP_GRACE_S
from ortflow.launch.layout import host_resources, launch_layout
from ortflow.launch.local import launch
from ortflow.launch.scheduled import run_scheduled
from ortflow.protocol import EXIT_NONFINITE, MPI_MISMATCH, RANK_REFUSED
from ortflow.tasks.caching import StageCache
from ortflow.tasks.charts import chart_markdown, loss_curve
from ortflow.tasks.policy import artifact_key, forward_logs, retry_transient
from ortflow.trainer.metrics import format_duration, read_progress
from ortflow.trainer.profile_report import top_operators_table
from ortflow.trainer.timing import read_timing

log = logging.getLogger(__name__)

#: Set by Prefect's workers and runners for the flow-run processes they start: the flow run's id.
FLOW_RUN_PROCESS_ENV = "PREFECT__FLOW_RUN_ID"


class TrainingFailed(RuntimeError):
    """The mpiexec job ended with a non-zero status (retried: training resumes from the last complete checkpoint),
    unless the ranks failed on an error that would repeat (``will_repeat``: a bad config, model, shape or path)."""

    def __init__(self, message: str, will_repeat: bool = False):
        super().__init__(message)
        self.will_repeat = will_repeat


#: Rank error lines that a second attempt would meet again (the config, the model, a shape, a path, bad data, a
#: micro-batch that does not fit in memory).
_REPEATING = re.compile(
    r"ConfigError|DataError|CheckpointError|ExportError|ValueError|TypeError|FileNotFoundError|PermissionError|"
    r"INVALID_ARGUMENT|INVALID_GRAPH|invalid dimensions|NOT_IMPLEMENTED|started with \d+ rank|"
    r"ran out of (?:GPU|host) memory|"
    + re.escape(MPI_MISMATCH) + r"|rank \d+ " + re.escape(RANK_REFUSED)
)


def failure_repeats(error_lines: tuple[str, ...], returncode: int = 1) -> bool:
    """Whether a failed job (its exit status and error lines) would fail the same way when run again."""
    return returncode == EXIT_NONFINITE or any(_REPEATING.search(line) for line in error_lines)


_RANK_LEVEL = re.compile(r"^\[(\d+)\]\s+(?:\d\d:\d\d:\d\d\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_RANK = re.compile(r"^\[(\d+)\]")


class RankLineLevels:
    """The log level of each rank output line: the level the rank logged it at; lines outside the log format
    (a traceback's lines, stderr) keep the level of that rank's previous line, and a ``Traceback`` is an ERROR."""

    def __init__(self) -> None:
        self.previous: dict[str, int] = {}

    def __call__(self, line: str) -> int:
        match = _RANK_LEVEL.match(line)
        rank = (match or _RANK.match(line) or [None, ""])[1]
        if match:
            level = logging.getLevelName(match[2])
        elif "Traceback (most recent call last)" in line:
            level = logging.ERROR
        else:
            level = self.previous.get(rank, logging.INFO)
        self.previous[rank] = level
        return level


def describe_progress(record: dict | None) -> str:
    """One markdown line for the progress artifact: step / total, losses, throughput, ETA."""
    if not record:
        return "starting the ranks"
    parts = [f"step {record.get('step')}/{record.get('total')}"]
    for key, label in (("loss", "loss"), ("eval_loss", "eval loss"), ("lr", "lr")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{label} {record[key]:.4g}")
    for key, label in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{record[key]:,.0f} {label}")
    if isinstance(record.get("eta_s"), (int, float)) and not record.get("final"):
        parts.append(f"ETA {format_duration(record['eta_s'])}")
    return " · ".join(parts)


def progress_line(record: dict) -> str:
    """A compact progress line: ``  train step 100/600 · loss 2.727 · eval loss 2.504 · 38 samples/s · ETA 3m53s``."""
    parts = [f"step {record.get('step')}/{record.get('total')}"]
    for key, label in (("loss", "loss"), ("eval_loss", "eval loss")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{label} {record[key]:.4g}")
    if isinstance(record.get("samples_per_s"), (int, float)):
        parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    if isinstance(record.get("eta_s"), (int, float)) and not record.get("final"):
        parts.append(f"ETA {format_duration(record['eta_s'])}")
    return "  train " + " · ".join(parts)


def progress_percent(record: dict | None) -> float:
    """Percent done from a progress record (0 before the first)."""
    if not record or not record.get("total"):
        return 0.0
    return max(0.0, min(100.0, 100.0 * record["step"] / record["total"]))


def final_description(record: dict | None, exc: BaseException | None, timed_out: bool = False,
                      checkpoint_step: int | None = None) -> str:
    """The progress artifact's last words: Completed, Failed at step N (why), Timed out, Stopped or Cancelled at
    step N.

    Args:
        record: The last progress record (written every ``display_loss_steps``).
        exc: What ended the attempt (None: it completed).
        timed_out: The attempt ran out of its time limit.
        checkpoint_step: The step of the newest complete checkpoint: a stop (timeout, signal, cancellation) names it,
            since the ranks stop after their current update, past the last progress record.
    """
    step = f"step {record.get('step')}/{record.get('total')}" if record else "before the first step"
    if exc is None:
        return f"Completed: {describe_progress(record)}"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    stopped = timed_out or isinstance(exc, (KeyboardInterrupt, SystemExit)) or type(exc).__name__ in (
        "TerminationSignal", "CancelledError", "Abort")
    if not stopped:
        return f"Failed at {step}: {reason}"
    if checkpoint_step is not None:
        step = f"step {checkpoint_step}" + (f"/{record['total']}" if record and record.get("total") else "")
    if timed_out:
        return f"Timed out at {step} (pipeline.train_timeout_s); the ranks stopped with a checkpoint"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) or type(exc).__name__ == "TerminationSignal":
        return f"Stopped by a signal at {step}; the ranks stopped with a checkpoint"
    return f"Cancelled at {step}; the ranks stopped with a checkpoint"


def _guard(config: RunConfig) -> JobGuard | None:
    """A guard for the job when this is a flow-run process of a worker or of ``ortflow serve``.

    Such a process can be killed without warning (a stopped Prefect process worker sends its flow-run processes
    SIGKILL at once): the guard then stops the ranks with a stop checkpoint and reports the flow run ``Crashed``
    (:func:`report_orphaned_stop`), so its deployment's concurrency slot is free for the next run.
    """
    if not os.environ.get(FLOW_RUN_PROCESS_ENV):
        return None  # the flow runs in the process that called it (`ortflow run`): its own signals stop the job
    return JobGuard(config.output_dir, STOP_GRACE_S, then="ortflow.tasks.training:report_orphaned_stop")


def report_orphaned_stop(run_dir: Path) -> None:
    """In the guard, after it stopped the job of a killed flow-run process: the ranks' last lines go to the flow
    run's logs, the flow run ends ``Crashed`` with where the ranks stopped, the version is recorded as stopped, and
    ortflow's final-state event goes out."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Crashed

    from ortflow import versions
    from ortflow.checkpoints import list_complete
    from ortflow.config import load_run_config
    from ortflow.tasks.events import announce_state

    flow_run_id = os.environ.get(FLOW_RUN_PROCESS_ENV)
    record = read_progress(run_dir) or {}
    try:
        config = load_run_config(run_dir)
        newest = list_complete(config.checkpoints_dir)
    except Exception:  # noqa: BLE001 - the state report must go out whatever the folder holds
        config, newest = None, []
    total = f"/{record['total']}" if record.get("total") else ""
    where = (f"at step {newest[-1].step}{total}, newest checkpoint {newest[-1].path}" if newest
             else "before the first checkpoint")
    message = f"Stopped {where}: the flow-run process was killed (a stopped worker does that), the ranks stopped"
    levels, now = RankLineLevels(), datetime.datetime.now(datetime.UTC)
    logs = [LogCreate(name="ortflow.launch.guard", level=levels(line), message=line, timestamp=now,
                      flow_run_id=flow_run_id)
            for line in taken_over_lines(run_dir / GUARD_LOG)] if flow_run_id else []
    print(message, flush=True)
    if run_dir.parent.name == versions.VERSIONS_DIR:
        base, name = run_dir.parent.parent, run_dir.name
        if any(v["version"] == name and v.get("status") == "running" for v in versions.read_registry(base)):
            versions.finish_version(base, name, "stopped")
    if not flow_run_id:
        return
    with get_client(sync_client=True) as client:
        # The final state first: it frees the deployment's concurrency slot; the rest is the record.
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
        client.create_logs(_not_yet_logged(client, flow_run_id, logs))  # what the killed process did not forward
        flow_run = client.read_flow_run(flow_run_id)
        if config is not None:
            step = f"step {newest[-1].step}{total}" if newest else "before the first checkpoint"
            _end_progress_artifact(client, flow_run_id, artifact_key(config, "progress"), record,
                                   f"Stopped at {step} (the flow-run process was killed); the ranks stopped with a "
                                   "checkpoint")
    announce_state(None, flow_run, flow_run.state)
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)


def _not_yet_logged(client: Any, flow_run_id: str, logs: list) -> list:
    """``logs`` less those the flow run's logs hold already: lines the killed process read while it stopped the job
    itself, some of which it may have sent before it was killed (each copy on the server cancels one here)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    if not logs:
        return logs
    try:
        sent = Counter(entry.message for entry in client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,  # the most one read returns
            sort=LogSort.TIMESTAMP_DESC))
    except Exception:  # noqa: BLE001 - a repeated line is better than a lost one
        return logs
    kept = []
    for entry in logs:
        if sent[entry.message] > 0:
            sent[entry.message] -= 1
        else:
            kept.append(entry)
    return kept


def _end_progress_artifact(client: Any, flow_run_id: str, key: str, record: dict, description: str) -> None:
    """The flow run's progress artifact ends with ``description`` instead of an ETA (best effort)."""
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    try:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                           flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
        if found:
            client.update_artifact(found[0].id, ArtifactUpdate(data=progress_percent(record), description=description))
    except Exception as err:  # noqa: BLE001 - the run's state is what matters; the artifact is a courtesy
        log.warning("progress artifact not updated: %s", err)


def _time_limit() -> float | None:
    """The task's time limit as a ``time.monotonic()`` deadline (None without one).

    Prefect delivers a sync task's timeout as an exception raised into the task's thread (an alarm signal or an
    injected exception); one that lands in a call that absorbs it is lost and the task runs on. The launcher's watch
    loop therefore stops the job at the same limit itself (a few seconds after Prefect's own timer, which counts from
    the task's start) and raises a TimeoutError, which Prefect records as TimedOut.
    """
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    limit = context.task.timeout_seconds if context else None
    return time.monotonic() + limit if limit else None


class _ProgressWatcher:
    """Polls ``progress.json`` from a small thread and mirrors it into one keyed Prefect progress artifact, which
    ends with the attempt's final state (never a stale ETA)."""

    def __init__(self, run_dir: Path, key: str, checkpoints_dir: Path, interval_s: float = 1.0):
        self.run_dir, self.checkpoints_dir = run_dir, checkpoints_dir
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.last: dict | None = None
        self.started = read_progress(run_dir)  # a record left by an earlier attempt
        self.begun = time.monotonic()
        self.artifact_id = create_progress_artifact(
            progress_percent(self.started), key=key, description=describe_progress(None)
        )
        # The thread runs in a copy of this context: Prefect's settings and run context are context variables, and a
        # bare thread would talk to another API (a temporary server of its own when the URL is set per context).
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._loop,), name="ortflow-progress", daemon=True)

    def _update(self) -> None:
        record = read_progress(self.run_dir)
        if record is not None and record != self.last:
            update_progress_artifact(self.artifact_id, progress_percent(record), description=describe_progress(record))
            self.last = record

    def _loop(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self._update()
            except Exception as err:  # noqa: BLE001 - a failed artifact update must not stop training
                log.debug("progress artifact update failed: %s", err)

    def _timed_out(self, exc: BaseException | None) -> bool:
        """A task timeout reaches the task as a cancellation; it is one once the task's time limit has passed."""
        from prefect.context import TaskRunContext

        context = TaskRunContext.get()
        limit = context.task.timeout_seconds if context else None
        return exc is not None and bool(limit) and time.monotonic() - self.begun >= 0.9 * limit

    def __enter__(self) -> _ProgressWatcher:
        self.thread.start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        try:
            record = read_progress(self.run_dir) or self.last
            self.last = record or self.last
            done = list_complete(self.checkpoints_dir) if exc is not None else []
            newest = done[-1].step if done and done[-1].step >= (record or {}).get("step", 0) else None
            final = final_description(record, exc, timed_out=self._timed_out(exc), checkpoint_step=newest)
            update_progress_artifact(self.artifact_id, progress_percent(record), description=final)
        except Exception as err:  # noqa: BLE001
            log.warning("progress artifact update failed: %s", err)


def publish_loss_curve(config: RunConfig) -> dict[str, list[tuple[int, float]]]:
    """The loss-curve chart artifact of the run, from its TensorBoard events; returns the points drawn."""
    curve = loss_curve(config.tensorboard_dir)
    create_markdown_artifact(chart_markdown(config.name, curve), key=artifact_key(config, "loss-curve"),
                             description=f"Train and eval loss of {config.name} against step")
    return curve


@task(
    name="train",
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=retry_transient,
    cache_policy=StageCache(stage="train"),
    persist_result=True,
    log_prints=True,
)
def train(config: RunConfig) -> dict:
    """Run the training job (``distributed.num_ranks`` ranks under mpiexec, or a Slurm or Kubernetes job) to the end.

    Safe to retry: the ranks resume from the newest complete checkpoint. On cancellation, timeout or Ctrl-C the
    launcher stops the job's whole process group (SIGTERM, then SIGKILL after its grace period).

    Args:
        config: The run config (configure and prepare_data done).

    Returns:
        The last progress record (step, total, loss, eval_loss, throughput) and the checkpoint folder.

    Raises:
        TrainingFailed: the job ended with a non-zero status; the message holds the ranks' last error lines.
    """
    # The ranks load the resolved config: configure may have been cached while train/distributed sections changed.
    target = config.output_dir / RESOLVED_CONFIG_NAME
    if not target.exists() or target.read_text() != dump_config(config):
        refusal = resume_layout_refusal(config)  # what the ranks would refuse is not recorded in the run folder
        if refusal:
            raise TrainingFailed(refusal, will_repeat=True)
        write_resolved_config(config)
    dist, pipe = config.distributed, config.pipeline
    from ortflow.tasks.runs import flow_run_id
    from ortflow.validate import training_path_problems

    updates = config.train.num_weight_updates
    if completed_run(config) is not None:  # the ranks would resume at the end and exit
        get_run_logger().info("ortflow: training is already complete at step %d/%d (checkpoints in %s): no ranks "
                              "started; to train further, raise train.num_train_steps", updates, updates,
                              config.checkpoints_dir)
        return {"progress": read_progress(config.output_dir) or {}, "checkpoints_dir": str(config.checkpoints_dir),
                "launcher": dist.launcher, "job_id": None}
    problems = training_path_problems(config)  # validate's check: refused before any rank starts, not retried
    if problems:
        raise TrainingFailed("; ".join(problems), will_repeat=True)

    local = dist.launcher == "local"  # else a Slurm or Kubernetes job places the ranks
    layout = launch_layout(config, config.output_dir, host_resources())[0] if local else None  # auto: this host's
    levels = RankLineLevels()
    deadline = _time_limit()
    with (
        runlock.hold_all(runlock.training_folders(config.output_dir, config.checkpoints_dir),
                         wait=pipe.wait_for_lock, timeout_s=pipe.lock_timeout_s, flow_run_id=flow_run_id(),
                         purpose="train"),
        forward_logs() as logger,
    ):
        try:
            key = artifact_key(config, "progress")
            with _ProgressWatcher(config.output_dir, key, config.checkpoints_dir) as watcher:
                on_line = lambda line: logger.log(levels(line), "%s", line)  # noqa: E731
                if layout is None:
                    result = run_scheduled(config, on_line=on_line, deadline=deadline)
                else:
                    result = launch(config.output_dir, layout.ranks, hostfile=dist.hostfile, num_hosts=dist.num_hosts,
                                    threads=layout.threads, on_line=on_line, guard=_guard(config),
                                    deadline=deadline)  # fmt: skip
                if not result.ok:
                    raise TrainingFailed(result.summary(), will_repeat=not result.retry
                                         or failure_repeats(result.error_lines, result.returncode))
        finally:
            try:
                publish_loss_curve(config)
            except Exception as err:  # noqa: BLE001 - the chart must not hide the training's own outcome
                logger.warning("loss curve artifact not published: %s", err)
    record = watcher.last or read_progress(config.output_dir) or {}
    rows = [{"metric": key, "value": record.get(key)} for key in
            ("step", "total", "loss", "eval_loss", "lr", "samples_per_s", "tokens_per_s")]
    rows.append({"metric": "launcher", "value": result.launcher})
    if result.job_id:
        rows.append({"metric": f"{result.launcher} job", "value": result.job_id})
    shares = (read_timing(config.output_dir) or {}).get("shares", {})  # where the run's wall time went
    rows += [{"metric": f"time share: {phase}", "value": share} for phase, share in shares.items()]
    create_table_artifact(rows, key=artifact_key(config, "training"),
                          description=f"Training of {config.name}: last progress record")
    top_ops = top_operators_table(config.output_dir)  # train.profile_steps: the per-operator profile
    if top_ops:
        create_table_artifact(top_ops, key=artifact_key(config, "top-operators"),
                              description=f"Training of {config.name}: top operators of the profiled updates")
    return {"progress": record, "checkpoints_dir": str(config.checkpoints_dir), "launcher": result.launcher,
            "job_id": result.job_id}
