"""The pipeline flow against a real local Prefect server: completion, reruns that skip finished stages, a killed
and retried train task (resumed in its own version folder, bit for bit), a train task timeout, and a diverging run."""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from prefect import flow

from ortflow import tasks
from ortflow.flows import train_pipeline
from ortflow.tasks.caching import invalidate
from ortflow.tasks.policy import artifact_key
from ortflow.trainer.metrics import read_progress
from tests.support.prefect_runs import final_parameters, mlp_config, processes_mentioning, rank_pids, wait_for

pytestmark = pytest.mark.prefect


def task_states(flow_run_id, wait_s: float = 60.0, expect: tuple[str, ...] = ("train",)) -> dict[str, str]:
    """Stage name -> state name ("Cached", "Completed", "Failed", ...) of a flow run's task runs, from the server.

    Task runs and their states reach the server as events that it records asynchronously, so right after a flow
    returns a task run may still read "Running", have no state, or not be there yet on a loaded machine (seen in CI):
    read again until every stage in ``expect`` is there and every task run has a final state, for up to ``wait_s``
    seconds. A stage in ``expect`` still missing then fails with the server log's last errors (why the server did not
    record it).
    """
    import time

    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            runs = read_task_runs(client, flow_run_id)
            names = {run.name.rsplit("-", 1)[0] for run in runs}
            settled = set(expect) <= names and all(run.state is not None and run.state.is_final() for run in runs)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    states = {run.name.rsplit("-", 1)[0]: run.state.name if run.state else "None" for run in runs}
    missing = [stage for stage in expect if stage not in states]
    assert not missing, (f"the server recorded no task run of {missing} of flow run {flow_run_id} in {wait_s:.0f} s "
                         f"(it has {states}); its log's last errors:\n{_server_errors()}")
    return states


def _server_errors(most: int = 10) -> str:
    """The last ERROR lines of the test server's log (``server.log`` in its PREFECT_HOME)."""
    from prefect.settings import PREFECT_HOME

    try:
        lines = (PREFECT_HOME.value() / "server.log").read_text(errors="replace").splitlines()
    except OSError as err:
        return f"(no server log: {err})"
    return "\n".join([line[:300] for line in lines if "| ERROR" in line][-most:]) or "(none)"


def read_task_runs(client, flow_run_id) -> list:
    """The flow run's task runs, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    return client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        limit=100,
    )


def artifacts_of(flow_run_id, kind: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
        FlowRunFilter,
        TaskRunFilter,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=[kind])
            ),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), sort=ArtifactSort.CREATED_DESC,
            limit=100, offset=0,
        )


STAGES = ("configure", "prepare_data", "train", "retain_checkpoints", "export")


def test_pipeline_completes_on_tiny_data_and_publishes_its_summary_and_loss_curve(
    prefect_server, mlp_sources, tmp_path
):
    from ortflow.checkpoints import list_complete
    from ortflow.tasks.charts import loss_curve

    cfg = mlp_config(tmp_path, mlp_sources, "complete", train={"display_loss_steps": 1, "evaluation_period": 5},
                     checkpoint={"period": 5, "max_num_checkpoints": 10})
    state = train_pipeline(cfg, return_state=True)

    assert state.is_completed(), state
    summary = state.result()
    assert summary["steps"] == "20/20"
    assert summary["exported model"] == str(cfg.export_path) and cfg.export_path.exists()
    assert summary["best eval loss"] is not None and summary["final eval loss"] is not None
    assert "step 20" in summary["kept checkpoints"]
    states = task_states(state.state_details.flow_run_id, expect=STAGES)
    assert all(states[s] == "Completed" for s in STAGES), states
    markdown = artifacts_of(state.state_details.flow_run_id, "markdown")
    assert any("best eval loss" in a.data and str(cfg.export_path) in a.data for a in markdown)
    progress = artifacts_of(state.state_details.flow_run_id, "progress")
    assert [a.data for a in progress] == [100.0]  # the train task's bar, finished
    key = artifact_key(cfg, "progress")
    assert key.startswith("ortflow-complete-") and key.endswith("-progress")
    assert progress[0].key == key and progress[0].description.startswith("Completed: step 20")
    keys = {a.key for kind in ("markdown", "table") for a in artifacts_of(state.state_details.flow_run_id, kind)}
    assert {artifact_key(cfg, kind) for kind in ("summary", "results", "training", "loss-curve")} <= keys

    # The loss-curve chart holds the run's losses: the ones the ranks recorded with each checkpoint.
    curve = loss_curve(cfg.tensorboard_dir)
    assert [s for s, _ in curve["train"]] == list(range(1, 21)) and [s for s, _ in curve["eval"]] == [5, 10, 15, 20]
    train, evals = dict(curve["train"]), dict(curve["eval"])
    metas = list_complete(cfg.checkpoints_dir)
    assert [m.step for m in metas] == [5, 10, 15, 20]
    for meta in metas:
        assert train[meta.step] == pytest.approx(meta.train_loss, rel=1e-6)
        assert evals[meta.step] == pytest.approx(meta.eval_loss, rel=1e-6)
    chart = next(a for a in markdown if a.key == artifact_key(cfg, "loss-curve"))
    assert "data:image/svg+xml;base64," in chart.data
    for step, loss in curve["train"]:
        assert f"| {step} | {loss:.6g} |" in chart.data


def test_rerun_after_failed_export_does_not_rerun_finished_stages(prefect_server, mlp_sources, tmp_path):
    broken = mlp_config(tmp_path, mlp_sources, "rerun", export={"outputs": ["no_such_output"]})
    failed = train_pipeline(broken, return_state=True)
    assert failed.is_failed()
    first = task_states(failed.state_details.flow_run_id, expect=STAGES)
    assert first["export"] == "Failed" and first["train"] == "Completed", first
    checkpoints = sorted(p.name for p in broken.checkpoints_dir.iterdir())

    fixed = mlp_config(tmp_path, mlp_sources, "rerun")  # the user fixes export.outputs and runs again
    rerun = train_pipeline(fixed, return_state=True)
    assert rerun.is_completed(), rerun
    second = task_states(rerun.state_details.flow_run_id, expect=STAGES)
    assert {s: second[s] for s in STAGES} == {
        "configure": "Cached", "prepare_data": "Cached", "train": "Cached", "retain_checkpoints": "Cached",
        "export": "Completed",
    }
    assert sorted(p.name for p in fixed.checkpoints_dir.iterdir()) == checkpoints
    assert fixed.export_path.exists()

    # An output that vanished makes its stage run again; --from reruns a stage and every later one.
    fixed.export_path.unlink()
    third = task_states(train_pipeline(fixed, return_state=True).state_details.flow_run_id, expect=STAGES)
    assert third["train"] == "Cached" and third["export"] == "Completed", third
    invalidate(fixed, "retain")
    fourth = task_states(train_pipeline(fixed, return_state=True).state_details.flow_run_id, expect=STAGES)
    assert [fourth[s] for s in STAGES] == ["Cached", "Cached", "Cached", "Completed", "Completed"], fourth


def test_train_task_killed_mid_run_is_retried_in_its_own_version_folder_and_ends_with_the_uninterrupted_parameters(
    prefect_server, mlp_sources, tmp_path
):
    import time

    from ortflow.checkpoints import list_complete
    from ortflow.config import load_run_config
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data
    from ortflow.launch.local import launch
    from ortflow.versions import read_registry

    sections = {
        "train": {"num_train_steps": 600, "display_loss_steps": 50, "evaluation_period": 0},
        "checkpoint": {"period": 50, "max_num_checkpoints": 100},  # every checkpoint stays as a record
        "pipeline": {"train_retry_delays_s": [0.5]},  # the retry itself is the subject, not its default delay
    }
    reference = mlp_config(tmp_path, mlp_sources, "uninterrupted", **sections)
    configure(reference)
    prepare_data(reference)
    # The uninterrupted reference trains beside the killed run: nothing below depends on their order or speed. (In
    # this test's settings context: Prefect's log handler sees the launcher's log lines.)
    background = ThreadPoolExecutor(1, thread_name_prefix="reference")
    uninterrupted = background.submit(contextvars.copy_context().run, launch, reference.output_dir, 2, threads=1,
                                      on_line=lambda line: None)
    background.shutdown(wait=False)

    cfg = mlp_config(tmp_path, mlp_sources, "killed", **sections)
    killed = []

    def kill_one_rank() -> None:
        # Wait for the version folder, a checkpoint in it and training under way, then SIGKILL one rank (a crashed
        # node).
        def running_version():
            running = [e for e in read_registry(cfg.output_dir) if e.get("status") == "running"]
            return running and Path(running[0]["path"])

        folder = wait_for(running_version, 120, "the version folder")

        def under_way() -> bool:
            r = read_progress(folder)
            return bool(r) and 150 <= r["step"] < 500 and bool(list_complete(folder / "checkpoints"))

        wait_for(under_way, 180, "training to pass step 150 with a checkpoint written")
        at = time.time()
        os.kill(rank_pids(folder)[0], signal.SIGKILL)
        killed.append(at)

    killer = threading.Thread(target=kill_one_rank, daemon=True)
    killer.start()
    state = train_pipeline(cfg, new_version=True, return_state=True)
    killer.join(timeout=5)
    assert uninterrupted.result(timeout=300).ok

    assert killed, "the rank was never killed"
    assert state.is_completed(), state
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = read_task_runs(client, state.state_details.flow_run_id)
    train_run = next(r for r in runs if r.name.startswith("train-"))
    assert train_run.run_count == 2  # failed once, retried once
    entries = read_registry(cfg.output_dir)
    assert len(entries) == 1 and entries[0]["status"] == "completed", entries
    assert entries[0]["flow_run_id"] == str(state.state_details.flow_run_id)
    folder = Path(entries[0]["path"])
    assert [p.name for p in (cfg.output_dir / "versions").iterdir()] == [folder.name]
    # The checkpoints are the record of progress: each folder's meta.json is written last, once. The retry resumed in
    # the same folder from the newest checkpoint of the killed attempt: every checkpoint written before the kill is
    # still the one the first attempt wrote, and the retry wrote only later steps. A restart from scratch would have
    # rewritten step 50 and every step after it.
    done = list_complete(folder / "checkpoints")
    assert [c.step for c in done] == list(range(50, 601, 50))
    written = {c.step: (c.path / "meta.json").stat().st_mtime for c in done}
    before = sorted(step for step, mtime in written.items() if mtime < killed[0])
    after = sorted(step for step, mtime in written.items() if mtime >= killed[0])
    assert before and after and max(before) < min(after), (before, after)
    assert entries[0]["final_checkpoint"] == str(done[-1].path)
    assert read_progress(folder)["step"] == 600
    # ... and it ends where the uninterrupted run ends, bit for bit.
    ours, theirs = final_parameters(load_run_config(folder)), final_parameters(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


@flow
def _train_with_timeout(config, timeout_s: float) -> None:
    tasks.train.with_options(timeout_seconds=timeout_s, retries=0)(config)


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except FileNotFoundError:
        return False


def _frozen_once_trained(cfg, started: float, thaw_at: float) -> threading.Thread:
    """A thread that stops (SIGSTOP) the two ranks once they reported a step after ``started`` (``time.time()``) and
    continues them at ``thaw_at`` (``time.monotonic()``), a moment before the task's time limit: they train when it
    passes, and do not burn both cores while the test waits for it."""
    import time

    def freeze_and_thaw() -> None:
        frozen: list[int] = []
        try:
            while time.monotonic() < thaw_at and not frozen:
                ranks = rank_pids(cfg.output_dir)
                if len(ranks) == 2 and _written_since(cfg.output_dir / "progress.json", started):
                    for pid in ranks:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGSTOP)
                            frozen.append(pid)
                else:
                    time.sleep(0.1)
            time.sleep(max(0.0, thaw_at - time.monotonic()))
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=freeze_and_thaw, daemon=True)
    thread.start()
    return thread


def test_train_task_timeout_stops_every_rank(prefect_server, mlp_sources, tmp_path):
    """A task timeout that fires while the ranks train stops every one of them.

    The ranks take a while to start on a loaded machine, and a timeout that fires before training began proves
    nothing: the test starts with a 6 s limit and, while an attempt ends before its ranks reported a step, doubles
    the limit (each attempt must still fail and leave no rank behind). Ranks that reported a step wait stopped
    (SIGSTOP) until a second before the limit, then train on until it stops them.
    """
    import time

    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    cfg = mlp_config(tmp_path, mlp_sources, "timeout",
                     train={"num_train_steps": 5000000, "display_loss_steps": 50, "evaluation_period": 0},
                     checkpoint={"period": 10000000})
    configure(cfg)
    prepare_data(cfg)
    timeout_s, trained_during = 6.0, None
    while trained_during is None and timeout_s <= 200:
        started = time.time()
        # The task's limit counts from the task's start, after this: the ranks continue before it passes.
        freezer = _frozen_once_trained(cfg, started, time.monotonic() + timeout_s - 1.0)
        state = _train_with_timeout(cfg, timeout_s, return_state=True)
        freezer.join()
        assert state.is_failed(), state
        assert task_states(state.state_details.flow_run_id)["train"] == "TimedOut"
        wait_for(lambda: not processes_mentioning(str(cfg.output_dir)), 60, "the ranks to exit after the timeout")
        record, path = read_progress(cfg.output_dir), cfg.output_dir / "progress.json"
        if record is not None and path.stat().st_mtime >= started and record["step"] < 5000000:
            trained_during = timeout_s
        timeout_s *= 2
    assert trained_during is not None, "training never started within any timeout up to 200 s"


def test_a_diverging_run_fails_once_without_retries_and_says_what_to_fix(prefect_server, mlp_sources, tmp_path):
    import time

    from prefect.client.orchestration import get_client

    from ortflow.cli.terminal import failure_advice

    rng = np.random.default_rng(0)
    features = (rng.normal(size=(64, 8)) * 1e37).astype(np.float32)  # finite, but x @ W overflows to inf
    np.savez(tmp_path / "huge.npz", features=features, labels=np.zeros(64, dtype=np.int64))
    cfg = mlp_config(tmp_path, {**mlp_sources, "data": tmp_path / "huge.npz"}, "diverging",
                     train={"num_train_steps": 50, "display_loss_steps": 1, "evaluation_period": 0})
    state = train_pipeline(cfg, return_state=True)
    ended = time.time()
    assert state.is_failed(), state
    with get_client(sync_client=True) as client:
        train_run = next(r for r in read_task_runs(client, state.state_details.flow_run_id)
                         if r.name.startswith("train-"))
    assert train_run.run_count == 1 and train_run.state.name == "Failed", train_run.state  # no retry
    try:
        state.result()
    except Exception as err:  # noqa: BLE001
        error = err
    assert "exit status 4" in str(error) and "non-finite" in str(error)
    assert failure_advice(error, "ortflow run c.yaml")[0].startswith("fix the problem above")
    print(f"the flow run ended {ended - train_run.start_time.timestamp():.1f} s after the train task started")
