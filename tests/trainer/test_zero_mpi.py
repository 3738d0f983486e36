"""ZeRO stage 1 for real under mpiexec: sharded optimizer state, identical ranks, resharding on resume. A killed
ZeRO-1 job resuming bitwise from its ranks' shards (LAMB and AdamW, with parameter groups):
test_optim_groups_mpi.py."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from ortflow.checkpoints import list_complete
from tests.support.runs import final_parameters, make_run, run_ranks_together
from tests.trainer.test_training_mpi import digests

pytestmark = pytest.mark.mpi

# Clipping on (max_grad_norm below the typical norm), so the sharded global norm is exercised every update.
SETTINGS = dict(optimizer={"learning_rate": 0.01, "weight_decay": 0.01, "max_grad_norm": 0.5,
                           "no_weight_decay": ["*bias"]},
                checkpoint={"period": 1, "max_num_checkpoints": 100})


def state_bytes(path) -> int:
    with h5py.File(path, "r") as f:
        return sum(ds.nbytes for group in f.values() for ds in group.values())


@pytest.fixture(scope="module")
def zero_pair(tmp_path_factory):
    """Finished 2-rank ZeRO-1 and ZeRO-0 runs (20 updates, a checkpoint after each); ZeRO-1's checkpoint after
    update 10 is where the other rank counts below resume."""
    root = tmp_path_factory.mktemp("zero")
    zero1 = make_run(root, "zero1", distributed={"num_ranks": 2, "zero_stage": 1}, **SETTINGS)
    zero0 = make_run(root, "zero0", distributed={"num_ranks": 2, "zero_stage": 0}, **SETTINGS)
    out1, out0 = run_ranks_together(zero1, zero0)  # independent jobs: at once
    assert out1.returncode == 0, out1.stdout
    assert out0.returncode == 0, out0.stdout
    return zero1, out1, zero0


def test_zero1_ranks_identical_every_update_equal_zero0_and_half_the_state(zero_pair):
    zero1, out1, zero0 = zero_pair
    # A checkpoint (and so a digest of each rank's parameters) after every update: identical after each.
    seen = digests(out1.stdout)
    assert {step for _, step in seen} == set(range(1, 21))
    for step in range(1, 21):
        assert seen[(0, step)] == seen[(1, step)], step
    # Equal to ZeRO-0 within fp32 rounding: with 2 ranks the reduce-scatter adds the same two numbers as the
    # all-reduce, so gradients are identical; the clipping norm is summed in another order (two float64 partial
    # sums instead of one), which can move the float32 clip factor by 1 ulp (6e-8 relative) per update. Over 20
    # updates such differences stay below 1e-6 relative to the parameters; a wrong shard (stale or another rank's
    # values) differs by 1e-3 or more.
    p1, p0 = final_parameters(zero1), final_parameters(zero0)
    for name in p0:
        np.testing.assert_allclose(p1[name], p0[name], rtol=2e-6, atol=1e-7, err_msg=name)
    # Optimizer state per rank: about half of ZeRO-0's (shards balanced by bytes, +-1 element).
    newest1, newest0 = list_complete(zero1.checkpoints_dir)[-1].path, list_complete(zero0.checkpoints_dir)[-1].path
    full = state_bytes(newest0 / "optimizer.h5")
    shards = [state_bytes(p) for p in sorted(newest1.glob("optimizer-rank*.h5"))]
    assert len(shards) == 2 and sum(shards) == full
    for shard in shards:
        assert abs(shard / full - 0.5) <= 8 / full, (shard, full)  # within one element of each of 2 states


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_two_rank_zero1_checkpoint_resumes_on_other_rank_counts(zero_pair, ranks):
    base = zero_pair[0]
    tmp_path = base.output_dir.parent  # the same model and data files
    start = next(c for c in list_complete(base.checkpoints_dir) if c.step == 10)
    assert len(list(start.path.glob("optimizer-rank*.h5"))) == 2
    runs = {}
    for stage in (1, 0):  # ZeRO-1 resharded vs ZeRO-0 started from the same state on the same number of ranks
        runs[stage] = make_run(tmp_path, f"r{ranks}z{stage}", distributed={"num_ranks": ranks, "zero_stage": stage},
                               train={"num_train_steps": 16}, optimizer=SETTINGS["optimizer"],
                               checkpoint={"period": 3, "max_num_checkpoints": 3,
                                           "checkpoint_to_load_path": str(start.path)})
    for out in run_ranks_together(*runs.values()):  # independent jobs: at once
        assert out.returncode == 0, out.stdout
        assert "starting from step 10" in out.stdout
        # train.batch_size is per rank: another rank count takes another batch, which the resume says, with the fix.
        assert (f"step-00000010 was trained with 8 samples per weight update; this run takes {4 * ranks} "
                f"({ranks} replica(s) x train.batch_size 4 x 1 micro-batch(es)): set train.global_batch_size: 8"
                in out.stdout), out.stdout
    last = list_complete(runs[1].checkpoints_dir)[-1]
    # Continued at the exact sample: 10 updates x 2 ranks x 4, then 6 updates x ranks x 4.
    assert last.step == 16 and last.meta["global_cursor"] == 10 * 2 * 4 + 6 * ranks * 4
    p1, p0 = final_parameters(runs[1]), final_parameters(runs[0])
    for name in p0:  # as above: identical gradients up to the reduction order of 3 ranks, a few fp32 ulps
        np.testing.assert_allclose(p1[name], p0[name], rtol=2e-6, atol=1e-7, err_msg=name)
