"""ZeRO-1 and Adasum over a pipeline stage's replicas (pp 2 x dp 2 under ``mpiexec -n 4``) against the same exchange
over unsplit replicas (dp 2): the split ends where the unsplit run ends, and a killed ZeRO-1 pipeline resumes
bitwise."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.checkpoints import list_complete
from tests.support.parallel_runs import kill_after_first_checkpoint
from tests.support.runs import make_text_run, run_ranks_together
from tests.trainer.test_pipeline_mpi import ATOL, TRAIN, stage_parameters

pytestmark = pytest.mark.mpi

GRID = {"num_ranks": 4, "pipeline_parallel_size": 2}
# Adasum combines whole tensors, as the unsplit exchange does: measured bitwise equal (ATOL allows fp32 rounding).
# ZeRO-1 cuts a stage's parameters into replica ranges other than the whole model's, so the clipping norm's float32
# chunk sums are grouped differently and the float32 clip factor can move by 1 ulp per update (as between ZeRO-1 and
# ZeRO-0, tests/trainer/test_zero_mpi.py); AdamW turns that into differences of a few 1e-6 in weights whose gradient
# is near zero (measured 2.7e-6 after 4 clipped updates at lr 1e-2). A wrong shard (stale or another replica's)
# moves weights by 1e-3 or more.
ZERO1_ATOL = 1e-5


def _train(*cfgs):
    """Train independent jobs to their ends, at once; returns the last one's output."""
    outs = run_ranks_together(*cfgs, timeout=300)
    for out in outs:
        assert out.returncode == 0, out.stdout[-4000:]
    return outs[-1]


CLIP = {"max_grad_norm": 0.5}  # below the measured norms (1.3-2.5): every update clips by the global norm
COMPARED = 4  # updates after which split and unsplit are compared (the bounds above were measured there)
# ZeRO-1 runs: 12 updates with a checkpoint after each, enough that the kill below lands mid-run.
ZERO1 = {"train": {**TRAIN, "num_train_steps": 24}, "optimizer": CLIP,
         "checkpoint": {"period": 1, "max_num_checkpoints": 20}}


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    """Finished ZeRO-1 runs over unsplit replicas (dp 2) and over a pipeline stage's replicas (pp 2 x dp 2), shared by
    the comparison (at update COMPARED) and as the uninterrupted reference of the kill/resume test."""
    root = tmp_path_factory.mktemp("zero1")
    unsplit = make_text_run(root, "dp2", distributed={"num_ranks": 2, "zero_stage": 1}, **ZERO1)
    split = make_text_run(root, "pp2dp2", distributed={**GRID, "zero_stage": 1}, **ZERO1)
    return unsplit, split, _train(unsplit, split)


def _at(cfg, step):
    return next(c.path for c in list_complete(cfg.checkpoints_dir) if c.step == step)


@pytest.mark.parametrize("exchange", [{"zero_stage": 1}, {"enable_adasum": True}], ids=["zero1", "adasum"])
def test_two_stages_by_two_replicas_match_the_same_exchange_over_unsplit_replicas(request, tmp_path, exchange):
    if exchange.get("zero_stage"):
        unsplit, split, out = request.getfixturevalue("zero1")
        p1, p2 = (stage_parameters(cfg, _at(cfg, COMPARED)) for cfg in (unsplit, split))
    else:
        unsplit = make_text_run(tmp_path, "dp2", distributed={"num_ranks": 2, **exchange}, train=TRAIN, optimizer=CLIP)
        split = make_text_run(tmp_path, "pp2dp2", distributed={**GRID, **exchange}, train=TRAIN, optimizer=CLIP)
        out = _train(unsplit, split)
        assert list_complete(split.checkpoints_dir)[-1].step == COMPARED
        p1, p2 = stage_parameters(unsplit), stage_parameters(split)
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    print(f"{exchange}: max |param diff| pp2 x dp2 vs dp2 after {COMPARED} updates: {worst}")
    assert worst < (ZERO1_ATOL if exchange.get("zero_stage") else ATOL)
    folder = list_complete(split.checkpoints_dir)[-1].path
    shards = sorted(f.name for f in folder.glob("optimizer-stage*-rank*.h5"))
    assert len(shards) == 4, shards  # each stage's two replicas write their own optimizer file
    assert "forward once, activations kept" in out.stdout


def test_a_killed_zero1_pipeline_resumes_bitwise(zero1):
    _, steady, _ = zero1
    killed = make_text_run(steady.output_dir.parent, "killed", distributed={**GRID, "zero_stage": 1}, **ZERO1)
    done = kill_after_first_checkpoint(killed)
    assert done and done[-1] < 12, done
    out = _train(killed)
    assert f"starting from step {done[-1]}" in out.stdout
    a, b = stage_parameters(steady), stage_parameters(killed)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
