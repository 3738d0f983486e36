"""A failure in the evaluation after the last update never costs the final checkpoint, in every layout: the trained
weights are saved before that evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortflow.checkpoints import list_complete
from tests.support.parallel_runs import gpt_run
from tests.support.runs import run_ranks

pytestmark = pytest.mark.mpi

FAULT = str(Path(__file__).with_name("eval_fault_rank.py"))
LAYOUTS = {"dp2": {"num_ranks": 2}, "pp2": {"num_ranks": 2, "pipeline_parallel_size": 2},
           "tp2": {"num_ranks": 2, "horizontal_parallel_size": 2},
           "pp2xtp2": {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_failing_final_evaluation_keeps_the_final_checkpoint(tmp_path, layout):
    cfg = gpt_run(tmp_path, layout, distributed=LAYOUTS[layout],
                  train={"num_train_steps": 4, "evaluation_period": 0}, checkpoint={"period": 0})
    out = run_ranks(cfg, FAULT, timeout=300)
    assert out.returncode != 0 and "injected failure in the final evaluation" in out.stdout, out.stdout[-3000:]
    final = list_complete(cfg.checkpoints_dir)
    assert [c.step for c in final] == [cfg.train.num_weight_updates]  # the last update's weights, complete
    assert final[-1].eval_loss is None  # saved before the evaluation that failed
