"""The train task: run the mpiexec job, forward its output, keep a Prefect progress artifact up to date."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from ortflow.config import RESOLVED_CONFIG_NAME, RunConfig, dump_config, write_resolved_config
from ortflow.tasks.caching import StageCache
from ortflow.tasks.common import forward_logs, retry_transient
from ortflow.trainer.launch import launch
from ortflow.trainer.layout import host_resources, launch_layout
from ortflow.trainer.metrics import format_duration, read_progress
from ortflow.trainer.profiling import top_operators_table
from ortflow.trainer.timing import read_timing

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """The mpiexec job ended with a non-zero status (retried: training resumes from the last complete checkpoint)."""


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


def progress_percent(record: dict | None) -> float:
    """Percent done from a progress record (0 before the first)."""
    if not record or not record.get("total"):
        return 0.0
    return max(0.0, min(100.0, 100.0 * record["step"] / record["total"]))


class _ProgressWatcher:
    """Polls ``progress.json`` from a small thread and mirrors it into one Prefect progress artifact."""

    def __init__(self, run_dir: Path, interval_s: float = 1.0):
        self.run_dir = run_dir
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.last: dict | None = None
        self.artifact_id = create_progress_artifact(0.0, description=describe_progress(None))
        self.thread = threading.Thread(target=self._loop, name="ortflow-progress", daemon=True)

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

    def __enter__(self) -> _ProgressWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        try:
            self._update()
        except Exception as err:  # noqa: BLE001
            log.warning("progress artifact update failed: %s", err)


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
    """Run the training job (``distributed.num_ranks`` ranks under mpiexec) to the end.

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
        write_resolved_config(config)
    dist = config.distributed
    layout, _ = launch_layout(config, config.output_dir, host_resources())  # num_ranks auto: this host's layout
    with forward_logs() as logger, _ProgressWatcher(config.output_dir) as watcher:
        result = launch(
            config.output_dir, layout.ranks, hostfile=dist.hostfile, num_hosts=dist.num_hosts,
            threads=layout.threads, on_line=logger.info,
        )
    if not result.ok:
        raise TrainingFailed(result.summary())
    record = watcher.last or read_progress(config.output_dir) or {}
    rows = [{"metric": key, "value": record.get(key)} for key in
            ("step", "total", "loss", "eval_loss", "lr", "samples_per_s", "tokens_per_s")]
    shares = (read_timing(config.output_dir) or {}).get("shares", {})  # where the run's wall time went
    rows += [{"metric": f"time share: {phase}", "value": share} for phase, share in shares.items()]
    create_table_artifact(rows, description=f"Training of {config.name}: last progress record")
    top_ops = top_operators_table(config.output_dir)  # train.profile_steps: the per-operator profile
    if top_ops:
        create_table_artifact(top_ops, description=f"Training of {config.name}: top operators of the profiled updates")
    return {"progress": record, "checkpoints_dir": str(config.checkpoints_dir)}
