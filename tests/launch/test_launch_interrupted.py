"""A task timeout reaches ``launch`` as an exception at any line: one that arrives after the job started but before
``launch`` watches it stops the job, as the watch would, instead of leaving its ranks running unwatched."""

from __future__ import annotations

import pytest

from ortflow.launch import local
from tests.support.prefect_runs import processes_mentioning, wait_for
from tests.support.runs import make_run


def test_a_launch_interrupted_right_after_its_job_started_stops_the_job(tmp_path, monkeypatch):
    cfg = make_run(tmp_path, "interrupted", train={"num_train_steps": 5000000, "evaluation_period": 0},
                   checkpoint={"period": 10000000})
    interrupted = []

    def timed_out(run_dir, launcher, job_id):  # the launch record is written once the job runs
        interrupted.append(job_id)
        raise TimeoutError("the task's time limit")

    monkeypatch.setattr(local, "write_record", timed_out)
    monkeypatch.setattr(local, "STOP_GRACE_S", 5.0)  # then the process tree is killed
    with pytest.raises(TimeoutError):
        local.launch(cfg.output_dir, 2, threads=1, on_line=lambda line: None)
    assert interrupted == [None]
    wait_for(lambda: not processes_mentioning(str(cfg.output_dir)), 30, "the interrupted job's ranks to exit")
