"""A failed served run in ``ortflow serve``'s terminal: one line naming the run, the stage, the error and where the
full log is, and no traceback (the run's logs on the server keep it). Against a real local Prefect server; the run
fails on a bad override before any rank starts, so the test costs one flow-run process. A run a stop signal ended is
said to be stopped, not failed (its records built here, as Prefect's engine logs them)."""

from __future__ import annotations

import pytest

from tests.prefect.serving import (
    assert_bad_batch_size_is_one_line,
    read_flow_run,
    serving,
    wait_for_failed_run_line,
)
from tests.support.prefect_runs import mlp_config, wait_for, write_config

pytestmark = pytest.mark.prefect


def test_a_failed_served_run_is_one_line_in_the_serve_terminal_and_its_traceback_stays_in_its_log(
        prefect_server, mlp_sources, tmp_path):
    from prefect.client.orchestration import get_client

    cfg = mlp_config(tmp_path, mlp_sources, "failing", distributed={"num_ranks": 1, "threads_per_rank": 1})
    config_file = write_config(cfg, tmp_path / "failing.yaml")
    log = tmp_path / "serve.log"
    with serving(config_file, prefect_server, "failing", tmp_path, log, flows=("train-pipeline",)):
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train-pipeline/failing")
            run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"overrides": ["train.batch_size=0"]})
        state = wait_for(lambda: (s := read_flow_run(run.id).state) is not None and s.is_final() and s, 240,
                         "the served run to end", 0.5)
        logs = wait_for_failed_run_line(log, run.id, "serve's output")
    # The error once, on the run's one line (Prefect's own error lines for the task, the flow and the engine are gone).
    assert_bad_batch_size_is_one_line(state, log.read_text(), logs, run, "train-pipeline/failing", also="ERROR")


def test_a_served_run_a_signal_stopped_is_one_line_that_says_stopped_not_an_error():
    import logging

    from ortflow.deployments.run_console import NoTraceback, ServedRunFailures

    def record(name: str, level: int, message: str, exc: BaseException | None = None) -> logging.LogRecord:
        made = logging.LogRecord(name, level, __file__, 1, message, (), (type(exc), exc, None) if exc else None)
        made.__dict__.update(flow_run_name="calm-fox", flow_run_id="1234", flow_name="train-pipeline",
                             deployment_name="served")
        return made

    console, formatter = ServedRunFailures(), NoTraceback(format="%(message)s")
    crash = record("prefect.flow_runs", logging.ERROR, "Crash detected! Execution was aborted by a termination signal.",
                   KeyboardInterrupt())
    assert not console.filter(crash)  # its traceback: the run's log on the server only
    end = record("prefect.flow_runs", logging.INFO,
                 "Finished in state Crashed('Execution was aborted by a termination signal.')")
    assert console.filter(end)
    assert formatter.format(end) == ("flow run calm-fox (train-pipeline/served) stopped by a signal: Execution was "
                                     "aborted by a termination signal.; full log with tracebacks: prefect flow-run "
                                     "logs 1234 (or the Prefect UI)")
    assert end.getMessage().startswith("Finished in state Crashed")  # the other handlers get the record unchanged
