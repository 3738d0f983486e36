"""A ``prefect worker`` of a process work pool against a real local Prefect server: SIGTERM to the worker in the
middle of training leaves a stop checkpoint, a final flow-run state (once the ranks stopped and the job's guard
reported), the ranks' stop lines in the flow run's logs, no rank process, and a free run folder and concurrency slot
for the deployment's next run."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow

from ortflow import runlock
from ortflow.processes import process_alive
from ortflow.versions import read_registry
from tests.faults.procs import descendants
from tests.prefect.serving import (
    assert_bad_batch_size_is_one_line,
    read_flow_run,
    slots_in_use,
    wait_for_failed_run_line,
)
from tests.support.prefect_runs import (
    FINAL_STATE_S,
    mlp_config,
    processes_mentioning,
    rank_pids,
    sigint_taken,
    wait_for,
)

pytestmark = pytest.mark.prefect

PREFECT = [sys.executable, "-m", "prefect"]
ROOT = Path(__file__).resolve().parents[2]


def _deploy(cfg, pool: str) -> object:
    """``train-pipeline/<name>`` on the process work pool ``pool`` (one run at a time); returns its id."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import EntrypointType

    from ortflow.flows import train_pipeline

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    deployment = train_pipeline.to_deployment(
        cfg.name, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH, tags=["ortflow", cfg.name],
        parameters={"config": cfg.model_dump(mode="json"), "new_version": True}, concurrency_limit=1,
    )
    return deployment.apply()


@contextlib.contextmanager
def worker(pool: str, env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    """``prefect worker start --pool POOL --type process`` until the block ends (then SIGKILL if still running)."""
    env = {**env, "PYTHONPATH": str(ROOT), "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    with log.open("w") as out:
        with sigint_taken():
            proc = subprocess.Popen([*PREFECT, "worker", "start", "--pool", pool, "--type", "process"], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        try:
            yield proc
        finally:
            # The flow-run processes it started run in sessions of their own and would outlive a killed worker
            # (still shipping their last logs to a server the session is about to stop): they end with the block.
            left = descendants(proc.pid) if proc.poll() is None else []
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            deadline = time.monotonic() + 10
            while any(process_alive(pid) for pid in left) and time.monotonic() < deadline:
                time.sleep(0.2)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _log_messages(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    with get_client(sync_client=True) as client:  # the newest 200, oldest first
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                sort=LogSort.TIMESTAMP_DESC)
    return [log.message for log in reversed(logs)]


#: A worker that takes its SIGTERM exits within this bound (it kills its flow-run processes and waits for nothing);
#: one still running then, whose run trains on, has missed the signal.
WORKER_EXIT_S = 30


def _guard_log(folder: Path) -> str:
    from ortflow.launch.guard import GUARD_LOG

    path = folder / GUARD_LOG
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(none)"


def _exits(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _training(output_dir: Path) -> Path:
    """The version folder of a versioned run once its two ranks train (rank 0 has reported progress)."""
    def ready():
        folders = list(Path(output_dir).glob("versions/*"))
        return folders and len(rank_pids(folders[0])) == 2 and (folders[0] / "progress.json").exists() and folders[0]

    return wait_for(ready, 300, "two ranks training")


def _final(flow_run_id):
    state = read_flow_run(flow_run_id).state
    return state if state is not None and state.is_final() else None


def test_sigterm_to_a_process_worker_stops_its_run_with_a_stop_checkpoint_and_frees_the_slot(
    prefect_server, mlp_sources, tmp_path
):
    from prefect.client.orchestration import get_client

    from ortflow.checkpoints import list_complete

    # No periodic checkpoint before the signal (period 1000000): the only checkpoint the run has is its stop one.
    cfg = mlp_config(tmp_path, mlp_sources, "worker-stop",
                     train={"num_train_steps": 4000000, "display_loss_steps": 20, "evaluation_period": 0},
                     checkpoint={"period": 1000000, "max_num_checkpoints": 2})
    deployment_id = _deploy(cfg, "ortflow-worker-stop")
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id)
    with worker("ortflow-worker-stop", prefect_server, tmp_path, tmp_path / "worker.log") as proc:
        folder = _training(cfg.output_dir)
        assert slots_in_use(deployment_id) == 1  # the training run holds the deployment's only slot
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # A worker that takes its SIGTERM cancels its flow-run tasks, which SIGKILLs their processes, and exits
        # ("Worker ... stopped!"); the job's guard then stops the ranks (stop checkpoint) and reports the final
        # state. A worker that misses its first SIGTERM (it turns it into SIGINT, which it ignores where its parent
        # did: `worker` makes sure it does not) waits for its run, which trains on, and the repeat that process
        # managers send makes it SIGKILL itself, whereupon the flow-run process stops the run itself.
        missed = False
        if not _exits(proc, WORKER_EXIT_S):
            log = (tmp_path / "worker.log").read_text()
            missed = "stopped!" not in log and len(rank_pids(folder)) == 2 and not _final(run.id)
            if missed:
                print(f"the worker missed its SIGTERM (its run trains on after {WORKER_EXIT_S} s): sending another")
                proc.send_signal(signal.SIGTERM)
        try:
            state = wait_for(lambda: _final(run.id), FINAL_STATE_S, "the flow run to reach a final state", 1)
        except AssertionError as err:
            raise AssertionError(f"{err}\nworker log:\n{(tmp_path / 'worker.log').read_text()[-3000:]}\n"
                                 f"guard log:\n{_guard_log(folder)}") from None
        took = time.monotonic() - sent
        wait_for(lambda: proc.poll() is not None, 90, "the worker to exit")
        ranks_gone = wait_for(lambda: not processes_mentioning(str(folder)), 30, "the ranks to exit")
    log = (tmp_path / "worker.log").read_text()
    print(f"final state {state.name} after {took:.1f} s; worker exit status {proc.returncode}")
    print(f"final state message: {state.message}\nguard log:\n{_guard_log(folder)}")
    assert state.type.value in ("CRASHED", "CANCELLED"), (state, log[-3000:])
    (stop,) = list_complete(folder / "checkpoints")  # written on the stop, not by the period
    assert 0 < stop.step < 1000000, (stop.step, log[-3000:])
    (entry,) = read_registry(cfg.output_dir)
    assert entry["status"] == "stopped", entry
    assert ranks_gone
    # Each rank's stop line is in the flow run's logs once: the guard copied it after the flow-run process was
    # killed, or that process read it while it stopped the job itself (Prefect may SIGTERM it before the kill), and
    # sent it or left it to the guard's report.
    stop_line = f"stop requested: ranks stopped together after step {stop.step} (checkpoint saved)"
    messages = _log_messages(run.id)
    for rank in (0, 1):
        assert sum(m.startswith(f"[{rank}] ") and stop_line in m for m in messages) == 1, (rank, messages[-20:])
    # The progress artifact ends with the stop instead of an ETA.
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    (progress,) = [a for a in artifacts if a.type == "progress"]
    # The guard writes "Stopped ..."; where the worker missed its first signal, the flow-run process outlives the
    # worker and writes the attempt's own last words, which must be final too (never a stale ETA).
    final_words = ("Stopped",) if not missed else ("Stopped", "Cancelled", "Failed at")
    assert progress.description.startswith(final_words) and "ETA" not in progress.description, progress.description
    # The run's folder and the deployment's only concurrency slot are free: the next run could start at once.
    assert runlock.holder(cfg.output_dir) is None and runlock.holder(folder) is None
    assert wait_for(lambda: slots_in_use(deployment_id) == 0, 30, "the concurrency slot to be released", 1)


def test_a_failed_run_is_one_line_in_the_workers_terminal_and_its_traceback_stays_in_its_log(
    prefect_server, mlp_sources, tmp_path
):
    """As in ``ortflow serve``'s terminal: a run a process worker executes that fails in a stage prints one line naming
    the run, the stage, the error and where the full log is, and no traceback; the run's log on the server keeps it.
    The run fails on a bad override before any rank starts (one flow-run process)."""
    from prefect.client.orchestration import get_client

    cfg = mlp_config(tmp_path, mlp_sources, "worker-fails", distributed={"num_ranks": 1, "threads_per_rank": 1})
    deployment_id = _deploy(cfg, "ortflow-worker-fails")
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters={"overrides": ["train.batch_size=0"]})
    log = tmp_path / "worker.log"
    with worker("ortflow-worker-fails", prefect_server, tmp_path, log):
        state = wait_for(lambda: _final(run.id), 240, "the worker's run to end", 0.5)
        logs = wait_for_failed_run_line(log, run.id, "the worker's output")
    assert_bad_batch_size_is_one_line(state, log.read_text(), logs, run, "train-pipeline/worker-fails")


@flow(name="orphaned")
def _orphaned() -> None:
    """A flow whose run the guard test reports on (it never executes)."""


def test_the_guards_report_of_an_orphaned_job_ends_its_flow_run_crashed_with_the_ranks_last_lines(
    prefect_server, tmp_path, monkeypatch
):
    """What the job's guard calls once it stopped the ranks of a killed flow-run process (the worker test's first
    SIGTERM, when the worker takes it): the flow run ends Crashed, saying where the ranks stopped, and the ranks'
    last lines go to its logs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Running

    from ortflow.launch.guard import GUARD_LOG
    from ortflow.tasks.training import FLOW_RUN_PROCESS_ENV, report_orphaned_stop

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(_orphaned, tags=["ortflow"], state=Running())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stop_line = "[0] 12:00:01 WARNING stop requested: ranks stopped together after step 7 (checkpoint saved)"
    # The killed process had asked the ranks to stop itself and read two lines, one of which it sent before it died.
    sent = "[1] 12:00:00 WARNING SIGTERM received: stopping after the current weight update"
    unsent = "[0] 12:00:00 WARNING SIGTERM received: stopping after the current weight update"
    (run_dir / GUARD_LOG).write_text(
        f"11:59:59 the launching process 1 asked the ranks to stop; the lines it read follow\n{sent}\n{unsent}\n"
        f"12:00:00 the launching process 1 is gone before its job ended\n{stop_line}\n")
    with get_client(sync_client=True) as client:
        client.create_logs([LogCreate(name="ortflow", level=30, message=sent, flow_run_id=run.id,
                                      timestamp=datetime.datetime.now(datetime.UTC))])
    wait_for(lambda: sent in _log_messages(run.id), 30, "the sent line on the server")
    monkeypatch.setenv(FLOW_RUN_PROCESS_ENV, str(run.id))
    report_orphaned_stop(run_dir)
    state = read_flow_run(run.id).state
    assert state.name == "Crashed", state
    assert state.message.startswith("Stopped before the first checkpoint: the flow-run process was killed"), state
    messages = _log_messages(run.id)
    assert [messages.count(line) for line in (sent, unsent, stop_line)] == [1, 1, 1], messages
