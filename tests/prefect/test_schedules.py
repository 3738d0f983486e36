"""Schedules against a real local Prefect server: the server's scheduler service creates runs of a served
deployment's interval schedule, and the runner executes them to Completed."""

from __future__ import annotations

import pytest

from tests.prefect.helpers import mlp_config, wait_for, write_config
from tests.prefect.serving import flow_runs_of, serving

pytestmark = pytest.mark.prefect


def test_interval_schedule_fires_and_the_scheduled_run_completes(prefect_server, mlp_sources, tmp_path):
    cfg = mlp_config(tmp_path, mlp_sources, "scheduled", schedule={"interval_s": 8})
    config_file = write_config(cfg, tmp_path / "scheduled.yaml")
    with serving(config_file, prefect_server, "scheduled", tmp_path, tmp_path / "serve.log"):
        def completed_scheduled_run():
            runs = [r for r in flow_runs_of("train-pipeline/scheduled") if r.auto_scheduled]
            failed = [r for r in runs if r.state and r.state.is_failed()]
            assert not failed, f"a scheduled run failed: {failed[0].state}\n{(tmp_path / 'serve.log').read_text()}"
            return next((r for r in runs if r.state and r.state.is_completed()), None)

        run = wait_for(completed_scheduled_run, 240, "a scheduled run to complete", interval=1)
    assert run.auto_scheduled  # created by the server's scheduler service, not by a client
    assert cfg.export_path.exists()
