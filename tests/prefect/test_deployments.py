"""Served deployments against a real local Prefect server: runs started with the CLI and with ``overrides`` complete
(from a start folder that would shadow ortflow) and the overrides change their run only, a second run of a folder a
served run trains (``ortflow run``, or a flow run) is refused with the holder named, a cancelled run leaves no rank
process alive, SIGTERM to ``ortflow serve`` stops its run with a stop checkpoint and frees the slot."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ortflow.config import load_run_config
from ortflow.versions import read_registry, resolve_run
from tests.prefect.serving import serving, slots_in_use
from tests.support.prefect_runs import (
    FINAL_STATE_S,
    mlp_config,
    processes_mentioning,
    rank_pids,
    wait_for,
    wait_for_periodic_checkpoint,
    write_config,
)

pytestmark = pytest.mark.prefect


def _flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def _final_state(flow_run_id, timeout: float, what: str = "the flow run to end"):
    """The flow run's final state, read from the server twice a second (each read costs the server a query)."""
    def final():
        state = _flow_run(flow_run_id).state
        return state if state is not None and state.is_final() else None

    return wait_for(final, timeout, what, interval=0.5)


@pytest.fixture(scope="module")
def served(prefect_server, mlp_sources, tmp_path_factory):
    """``ortflow serve CONFIG`` in a subprocess, until the module's tests are done (the last one stops it). It starts
    from a folder holding a package named ``ortflow`` that fails on import: served runs must import the installed
    ortflow instead."""
    root = tmp_path_factory.mktemp("served")
    # One rank: the runs of the served config only complete; the tests that start ranks to stop pass 2-rank configs.
    cfg = mlp_config(root, mlp_sources, "served", distributed={"num_ranks": 1, "threads_per_rank": 1})
    config_file = write_config(cfg, root / "served.yaml")
    start = root / "checkout"
    (start / "ortflow").mkdir(parents=True)
    (start / "ortflow" / "__init__.py").write_text("raise ImportError('the start folder was imported')\n")
    with serving(config_file, prefect_server, "served", start, root / "serve.log") as proc:
        yield {"cfg": cfg, "root": root, "env": prefect_server, "log": root / "serve.log", "proc": proc}


def test_served_runs_started_with_prefect_cli_and_with_overrides_complete_and_overrides_change_one_run_only(served):
    from prefect.client.orchestration import get_client

    cfg = served["cfg"]
    with get_client(sync_client=True) as client:  # queued first: the deployment runs one at a time
        deployment = client.read_deployment_by_name("train-pipeline/served")
        short = client.create_flow_run_from_deployment(
            deployment.id, parameters={"overrides": ["train.num_train_steps=10", "train.evaluation_period=5"]})
    done = subprocess.run(  # a plain run, as users start one
        [sys.executable, "-m", "prefect", "deployment", "run", "train-pipeline/served", "--watch",
         "--watch-timeout", "240"],
        env=served["env"], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr + served["log"].read_text()[-3000:]
    assert "Completed" in done.stdout + done.stderr
    state = _final_state(short.id, 240, "the run with overrides to end")
    assert state.is_completed(), (state, served["log"].read_text()[-3000:])
    entries = read_registry(cfg.output_dir)
    assert len(entries) == 2 and all(e["status"] == "completed" for e in entries), entries
    (plain,) = [e for e in entries if e["flow_run_id"] != str(short.id)]
    steps = {e["flow_run_id"]: e["steps"] for e in entries}
    assert steps[str(short.id)] == "10/10" and plain["steps"] == "20/20"
    assert load_run_config(Path(plain["path"])).train.num_train_steps == 20
    latest = resolve_run(cfg.output_dir / "latest")  # a served run trains a new version
    assert latest.parent == cfg.output_dir / "versions" and latest in {Path(e["path"]) for e in entries}
    assert (latest / "export" / "model.onnx").exists() and (latest / "checkpoints.json").exists()


def _flow_run_process(pid: int) -> int | None:
    """The flow-run process (``python -m prefect.engine``) that ``pid`` descends from."""
    while pid > 1:
        try:
            if b"prefect.engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None
    return None


@contextlib.contextmanager
def _frozen(pids: list[int]) -> Iterator[None]:
    """The processes are stopped (SIGSTOP) in the block and continue after it."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _second_runs_refused(long, served, run, holder: int, ranks: list[int], versions: list[Path]) -> None:
    """A second run of the folder while the served run holds it: ``ortflow run`` and a run that reaches the flow
    are refused with the holder named, and start nothing."""
    from ortflow.flows import train_pipeline

    # A second run of the folder while the served run trains it: `ortflow run` is refused with the holder named.
    config_file = write_config(long, served["root"] / "cancelled.yaml")
    second = subprocess.run([sys.executable, "-m", "ortflow", "run", str(config_file)], env=served["env"],
                            capture_output=True, text=True, timeout=120)
    message = second.stdout + second.stderr
    assert second.returncode == 1, message
    assert f"is in use by pid {holder} on {os.uname().nodename}" in message, message
    assert f"flow run {run.id}" in message and "pipeline" in message, message
    assert "--wait" in message  # the command that queues instead
    assert "launching" not in message  # the second run never started ranks: nothing trained twice
    # A run that reaches the flow (a served or scheduled one) is refused there, by the same lock.
    flowed = train_pipeline(long, return_state=True)
    assert flowed.is_failed()
    with pytest.raises(Exception, match=f"is in use by pid {holder} on "):
        flowed.result()
    assert sorted(rank_pids(long.output_dir)) == ranks
    assert sorted(long.output_dir.glob("versions/*")) == versions


def test_a_second_run_on_a_busy_folder_is_refused_with_the_holder_named_and_cancelling_the_holder_leaves_no_rank_alive(
        served, mlp_sources):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    long = mlp_config(served["root"], mlp_sources, "cancelled",
                      train={"num_train_steps": 200000, "display_loss_steps": 50, "evaluation_period": 0},
                      checkpoint={"period": 1000, "max_num_checkpoints": 1})
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train-pipeline/served")
        # The whole RunConfig goes through the API as JSON and is validated again by the flow run.
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": long.model_dump(mode="json")})
    wait_for(lambda: len(rank_pids(long.output_dir)) == 2 and any(long.output_dir.glob("versions/*/progress.json")),
             240, "two ranks training")  # a served run trains a new version
    ranks, versions = sorted(rank_pids(long.output_dir)), sorted(long.output_dir.glob("versions/*"))
    holder = _flow_run_process(ranks[0])
    assert holder is not None, "the ranks do not descend from a flow-run process"
    with _frozen(ranks):  # the run holds its folder meanwhile; its ranks need not burn two cores
        _second_runs_refused(long, served, run, holder, ranks, versions)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    state = _final_state(run.id, 90)
    assert state.name == "Cancelled", state
    leftover = wait_for(lambda: not processes_mentioning(str(long.output_dir)) or None, 45,
                        "every process of the cancelled run to exit")
    assert leftover
    assert processes_mentioning(str(long.output_dir)) == []


def test_sigterm_to_ortflow_serve_stops_its_run_with_a_stop_checkpoint_frees_the_slot_and_starts_no_queued_run(
        served, mlp_sources):
    """Stops the module's ``ortflow serve``: the module's last test. A second run waits for the deployment's only
    slot; the slot the stopped run frees does not start it while serve stops (it stays queued for the next serve)."""
    import signal
    import time

    from prefect.client.orchestration import get_client

    from ortflow import runlock
    from ortflow.checkpoints import list_complete

    long = mlp_config(served["root"], mlp_sources, "serve-stop",
                      train={"num_train_steps": 4000000, "display_loss_steps": 100, "evaluation_period": 0},
                      checkpoint={"period": 500, "max_num_checkpoints": 2})
    proc, log_start = served["proc"], served["log"].stat().st_size  # this test's part of the log starts here
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train-pipeline/served")
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": long.model_dump(mode="json")})
    queued_cfg = mlp_config(served["root"], mlp_sources, "serve-stop-queued",
                            train={"num_train_steps": 4000000, "display_loss_steps": 100, "evaluation_period": 0})

    folder = wait_for_periodic_checkpoint(long.output_dir)
    with _frozen(sorted(rank_pids(folder))):  # the ranks need not burn two cores while the second run queues
        with get_client(sync_client=True) as client:
            queued = client.create_flow_run_from_deployment(
                deployment.id, parameters={"config": queued_cfg.model_dump(mode="json")})
        wait_for(lambda: _flow_run(queued.id).state.name == "AwaitingConcurrencySlot" or None, 60,
                 "the second run to wait for the slot", 0.5)
        last_periodic = list_complete(folder / "checkpoints")[-1].step
        assert slots_in_use(deployment.id) == 1  # the training run holds the deployment's only slot
    sent = time.monotonic()  # the ranks train again: the stop comes between two periodic checkpoints
    proc.send_signal(signal.SIGTERM)
    state = _final_state(run.id, FINAL_STATE_S, "the flow run to reach a final state")
    print(f"final state {state.name} {time.monotonic() - sent:.1f} s after the SIGTERM")
    proc.wait(timeout=90)
    assert state.type.value in ("CRASHED", "CANCELLED"), state
    stop = list_complete(folder / "checkpoints")[-1]
    assert stop.step > last_periodic and stop.step % 500 != 0, (stop.step, last_periodic)  # written on the stop
    (entry,) = read_registry(long.output_dir)
    assert entry["status"] == "stopped", entry
    assert not processes_mentioning(str(folder))
    assert b"Traceback" not in served["log"].read_bytes()[log_start:]
    # The run's folder and the deployment's only concurrency slot are free: the next run could start at once.
    assert runlock.holder(long.output_dir) is None and runlock.holder(folder) is None
    assert wait_for(lambda: slots_in_use(deployment.id) == 0, 30, "the concurrency slot to be released", 1)
    # The queued run never started: still waiting on the server, nothing of it on this machine.
    waiting = _flow_run(queued.id)
    assert waiting.state.type.value == "SCHEDULED" and not waiting.run_count, waiting.state
    assert not processes_mentioning(str(queued_cfg.output_dir)) and not queued_cfg.output_dir.exists()
    with get_client(sync_client=True) as client:
        client.delete_flow_run(queued.id)
