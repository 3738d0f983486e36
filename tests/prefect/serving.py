"""``ortflow serve`` in a subprocess and flow-run queries against the test server."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support.prefect_runs import wait_for


def deployment_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
        return True
    except ObjectNotFound:
        return False


def flow_runs_of(deployment_name: str) -> list:
    """Every flow run of a deployment, oldest expected start first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(deployment_name)
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=200,
        )


def read_flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def start_serve(config_file: Path, env: dict[str, str], cwd: Path, log: Path, extra: list[str] = ()
                ) -> subprocess.Popen:
    """``ortflow serve CONFIG [EXTRA...]`` from ``cwd`` in a subprocess writing to ``log``; returns at once."""
    with log.open("w") as out:
        # The console script, as users run it (``python -m`` would put the start folder first on sys.path).
        return subprocess.Popen([str(Path(sys.executable).parent / "ortflow"), "serve", str(config_file), *extra],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)


def wait_served(proc: subprocess.Popen, name: str, log: Path,
                flows: tuple[str, ...] = ("train-pipeline", "export-only"), timeout: float = 240) -> None:
    """Wait for the deployments of ``flows`` named ``name`` to exist, while ``proc`` (``ortflow serve``) runs (a
    liveness bound: serve's start takes seconds of CPU, and minutes on a machine whose cores are shared many times)."""
    wait_for(lambda: proc.poll() is not None or all(deployment_exists(f"{flow}/{name}") for flow in flows),
             timeout, f"ortflow serve to register the deployments of {name}", 0.5)
    assert proc.poll() is None, log.read_text()[-3000:]


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM (the runner pauses its schedules and exits), SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serving(config_file: Path, env: dict[str, str], name: str, cwd: Path, log: Path, extra: list[str] = (),
            flows: tuple[str, ...] = ("train-pipeline", "export-only")) -> Iterator[subprocess.Popen]:
    """Run ``ortflow serve CONFIG [EXTRA...]`` from ``cwd`` until the block ends; waits for the deployments of
    ``flows`` (default both) to exist."""
    proc = start_serve(config_file, env, cwd, log, extra)
    try:
        wait_served(proc, name, log, flows)
        yield proc
    finally:
        stop_serve(proc)


def slots_in_use(deployment_id) -> int:
    """Concurrency slots of a deployment (``concurrency_limit``) that its runs hold now."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limit = client.read_deployment(deployment_id).global_concurrency_limit
    assert limit is not None, "the deployment has no concurrency limit"
    return limit.active_slots


def wait_for_failed_run_line(log: Path, run_id, where: str) -> list:
    """Wait until the output in ``log`` holds a failed flow run's one line (it comes from the flow-run process as it
    ends; Prefect's own last line of the run where the one line is missing), then return the run's log entries on the
    server once they hold its traceback (the flow-run process sends its log entries in batches, the last as it exits:
    they reach a loaded server after the line reaches the terminal)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    wait_for(lambda: any(end in log.read_text() for end in (f"flow-run logs {run_id}", "Finished in state Failed")),
             60, f"the failed run's line in {where}", 0.5)
    with get_client(sync_client=True) as client:
        def with_traceback() -> list | None:
            entries = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            return entries if any("Traceback (most recent call last)" in e.message for e in entries) else None

        return wait_for(with_traceback, 60, "the failed run's traceback in its log on the server", 0.5)


def assert_bad_batch_size_is_one_line(state, output: str, logs: list, run, deployment: str,
                                      also: str | None = None) -> None:
    """A run failed on ``train.batch_size=0`` shows in ``output`` (a terminal) as one line naming the run, the
    deployment, the stage, the error and ``prefect flow-run logs ID``, without a traceback, while the run's log on the
    server keeps the traceback. ``also``: another marker of lines that must not appear beside it (e.g. ``ERROR``)."""
    assert state.is_failed(), (state, output[-3000:])
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "batch_size" in line or (also and also in line)]
    assert len(lines) == 1, output
    (line,) = lines
    assert re.match(rf"error: flow run {re.escape(run.name)} \({re.escape(deployment)}\) failed in resolve_config: "
                    r"ConfigError: 1 problem\(s\) in overrides train.batch_size=0: - train.batch_size: Input should "
                    r"be greater than 0; ", line), line
    assert f"prefect flow-run logs {run.id}" in line, line
    assert any("Traceback (most recent call last)" in entry.message for entry in logs), [e.message for e in logs]
