"""Parameter groups under mpiexec: ZeRO-1 with two groups resumes a killed job bitwise, saves the groups in the
optimizer files, and equals ZeRO-0 with the same groups."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from ortflow.checkpoints import list_complete
from tests.support.runs import final_parameters, kill_and_resume, make_run

pytestmark = pytest.mark.mpi

GROUPS = [{"params": ["*bias"], "lr_scale": 3.0, "weight_decay": 0.0}, {"params": ["fc2.*"], "betas": [0.8, 0.99]}]


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_two_groups_on_zero1_resume_a_killed_job_bitwise(tmp_path, name):
    settings = dict(distributed={"num_ranks": 2, "zero_stage": 1}, train={"num_train_steps": 200, "batch_size": 8},
                    checkpoint={"period": 25, "max_num_checkpoints": 2},
                    optimizer={"name": name, "learning_rate": 0.01, "weight_decay": 0.05, "groups": GROUPS},
                    lr_schedule={"name": "cosine", "warmup_steps": 10})
    steady = make_run(tmp_path, "steady", **settings)
    killed = make_run(tmp_path, "killed", **settings)
    zero0 = make_run(tmp_path, "zero0", **{**settings, "distributed": {"num_ranks": 2, "zero_stage": 0}})
    kill_and_resume(killed, min_step=60, end_step=200, beside=(steady, zero0))
    a, b = final_parameters(steady), final_parameters(killed)
    for param in a:
        assert np.array_equal(a[param], b[param]), param
    newest = list_complete(steady.checkpoints_dir)[-1].path
    held: list[set] = [set(), set(), set()]
    for shard in sorted(newest.glob("optimizer-rank*.h5")):  # every rank's file records the groups as applied
        with h5py.File(shard, "r") as f:
            groups, names = json.loads(f.attrs["groups"]), json.loads(f.attrs["group_members"])
        assert [g["patterns"] for g in groups] == [["*bias"], ["fc2.*"], ["*"]]
        assert [g["lr_scale"] for g in groups] == [3.0, 1.0, 1.0] and groups[1]["beta1"] == 0.8
        assert [g["weight_decay"] for g in groups] == [0.0, 0.05, 0.05]
        for k, group in enumerate(names):  # this rank's share of the parameters, by group
            held[k] |= set(group)
    assert held == [{"fc1.bias", "fc2.bias"}, {"fc2.weight"}, {"fc1.weight"}]
    # ZeRO-0 with the same groups: the same parameters to fp32 rounding (a group's settings lost on a shard would
    # differ by far more).
    for param, value in final_parameters(zero0).items():
        np.testing.assert_allclose(a[param], value, rtol=2e-5, atol=1e-6, err_msg=param)
