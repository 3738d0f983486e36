"""Served deployments against a real local Prefect server: a run started with the CLI completes; a cancelled run
leaves no rank process alive."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.prefect.helpers import mlp_config, processes_mentioning, rank_pids, wait_for, write_config

pytestmark = pytest.mark.prefect


def _deployment_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
        return True
    except ObjectNotFound:
        return False


def _flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


@pytest.fixture(scope="module")
def served(prefect_server, mlp_sources, tmp_path_factory):
    """``ortflow serve CONFIG`` in a subprocess, until the module's tests are done."""
    root = tmp_path_factory.mktemp("served")
    cfg = mlp_config(root, mlp_sources, "served")
    config_file = write_config(cfg, root / "served.yaml")
    log = (root / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ortflow.cli", "serve", str(config_file)], env=prefect_server, stdout=log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _deployment_exists("train-pipeline/served") and _deployment_exists("export-only/served"),
                 90, "ortflow serve to register its deployments")
        yield {"cfg": cfg, "root": root, "env": prefect_server, "log": root / "serve.log"}
    finally:
        proc.terminate()  # the runner pauses its schedules and exits on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_served_deployment_started_with_prefect_cli_completes(served):
    cfg = served["cfg"]
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "deployment", "run", "train-pipeline/served", "--watch",
         "--watch-timeout", "180"],
        env=served["env"], capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr + served["log"].read_text()[-3000:]
    assert "Completed" in done.stdout + done.stderr
    assert cfg.export_path.exists()
    assert (cfg.output_dir / "checkpoints.json").exists()


def test_cancelling_a_flow_run_leaves_no_rank_process_alive(served, mlp_sources):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    long = mlp_config(served["root"], mlp_sources, "cancelled",
                      train={"num_train_steps": 200000, "display_loss_steps": 5, "evaluation_period": 0},
                      checkpoint={"period": 1000, "max_num_checkpoints": 1})
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train-pipeline/served")
        # The whole RunConfig goes through the API as JSON and is validated again by the flow run.
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": long.model_dump(mode="json")})
    wait_for(lambda: len(rank_pids(long.output_dir)) == 2 and (long.output_dir / "progress.json").exists(), 120,
             "two ranks training")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    state = wait_for(lambda: _flow_run(run.id).state if _flow_run(run.id).state.is_final() else None, 90,
                     "the flow run to end")
    assert state.name == "Cancelled", state
    leftover = wait_for(lambda: not processes_mentioning(str(long.output_dir)) or None, 45,
                        "every process of the cancelled run to exit")
    assert leftover
    assert processes_mentioning(str(long.output_dir)) == []
