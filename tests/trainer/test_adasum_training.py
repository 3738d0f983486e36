"""Adasum in the trainer: the exchange's two modes, and real 2-rank training under mpiexec (identity, resume)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow.checkpoints import list_complete
from ortflow.trainer.optim.adasum_update import AdasumExchange, adasum_mode
from tests.support.runs import final_parameters, kill_and_resume, make_run, run_ranks_together
from tests.trainer.test_adasum import reference


class _TwoRanks:
    """Rank 0 of a 2-rank group whose other rank contributes ``other`` (float64 reference arithmetic)."""

    rank, size = 0, 2

    def __init__(self, other: list[np.ndarray]):
        self.other = other
        self.calls = 0

    def adasum_tensors(self, tensors, divisor, scalars, peers=None):
        assert peers is None  # whole tensors: the tree runs over this group itself
        self.calls += 1
        for t, o in zip(tensors, self.other, strict=True):
            t[...] = reference([t.astype(np.float64) / divisor, o], [t.size])
        if scalars.size:
            scalars[:] = scalars * 2

    def allreduce_sum(self, values, label):
        return np.asarray(values, dtype=np.float64) * 2

    def gradient_norm(self, grads):
        return float(np.sqrt(sum(float(g @ g) for g in grads)))


def test_deltas_mode_steps_locally_and_applies_the_adasum_of_the_updates():
    params = [np.array([1.0, 2.0, 3.0], np.float32), np.array([-1.0, 0.5], np.float32)]
    start = [p.copy() for p in params]
    other = [np.array([0.1, 0.0, -0.2]), np.array([0.3, 0.3])]
    comm = _TwoRanks(other)
    exchange = AdasumExchange(comm, params, "deltas")
    grads = [np.array([2.0, 2.0, 2.0], np.float32), np.array([4.0, -4.0], np.float32)]
    scalars = np.array([1.0, 0.0], np.float32)
    mine = exchange.reduce(grads, 4.0, scalars)  # 2 micro-batches x 2 ranks: the local mean halves the sum
    assert comm.calls == 0 and scalars.tolist() == [2.0, 0.0]  # no Adasum before the local step
    np.testing.assert_array_equal(mine[0], [1.0, 1.0, 1.0])
    for p, g in zip(params, mine, strict=True):  # a stand-in local step: p -= 0.1 * g
        p -= np.float32(0.1) * g
    exchange.gather()
    for p, s, g, o in zip(params, start, mine, other, strict=True):
        delta = -0.1 * g.astype(np.float64)
        np.testing.assert_allclose(p, s + reference([delta, o], [s.size]), rtol=1e-6, atol=1e-7)


def test_gradients_mode_combines_the_mean_gradients_before_the_step():
    params = [np.zeros(3, np.float32)]
    comm = _TwoRanks([np.array([0.0, 1.0, 0.0])])  # orthogonal to ours: Adasum adds
    exchange = AdasumExchange(comm, params, "gradients")
    # divisor 4 = 2 micro-batches x 2 ranks: this rank's mean gradient is half its sum.
    mine = exchange.reduce([np.array([2.0, 0.0, 0.0], np.float32)], 4.0, np.zeros(2, np.float32))
    np.testing.assert_array_equal(mine[0], [1.0, 1.0, 0.0])
    exchange.gather()
    assert adasum_mode("sgd") == "gradients" and adasum_mode("adamw") == adasum_mode("lamb") == "deltas"


def _digests(output: str) -> dict[tuple[int, int], str]:
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", output)
    return {(int(rank), int(step)): digest for rank, digest, step in found}


# AdamW's runs: 200 updates, enough that the kill below lands between two checkpoints.
LONG = {"train": {"num_train_steps": 200, "batch_size": 8}, "checkpoint": {"period": 25, "max_num_checkpoints": 2}}
ADASUM = {"num_ranks": 2, "enable_adasum": True}


@pytest.fixture(scope="module")
def adamw_steady(tmp_path_factory):
    """A finished 2-rank Adasum AdamW run (LONG), shared by the identity test and as the kill/resume reference, and
    the same run with the mean (the identity test's comparison), trained at once."""
    root = tmp_path_factory.mktemp("adasum")
    cfg = make_run(root, "ada", distributed=ADASUM, optimizer={"name": "adamw"}, **LONG)
    mean = make_run(root, "mean", distributed={"num_ranks": 2}, optimizer={"name": "adamw"}, **LONG)
    out, done = run_ranks_together(cfg, mean, timeout=300)  # independent jobs: at once
    assert out.returncode == 0, out.stdout[-3000:]
    assert done.returncode == 0, done.stdout[-3000:]
    return cfg, out, mean


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", [{"name": "sgd", "learning_rate": 0.05}, {"name": "adamw"}, {"name": "lamb"}])
def test_adasum_ranks_stay_identical_and_differ_from_the_mean(request, tmp_path, optimizer):
    if optimizer["name"] == "adamw":
        ada, out, mean = request.getfixturevalue("adamw_steady")
        settings = LONG
    else:
        settings = {"train": {"num_train_steps": 20}}
        ada = make_run(tmp_path, "ada", distributed=ADASUM, optimizer=optimizer, **settings)
        mean = make_run(tmp_path, "mean", distributed={"num_ranks": 2}, optimizer=optimizer, **settings)
        out, done = run_ranks_together(ada, mean)  # independent jobs: at once
        assert out.returncode == 0, out.stdout[-3000:]
        assert done.returncode == 0, done.stdout[-3000:]
    seen = _digests(out.stdout)
    updates, period = settings["train"]["num_train_steps"], settings.get("checkpoint", {}).get("period", 5)
    assert {step for _, step in seen} == set(range(period, updates + 1, period))
    assert all(seen[(0, step)] == seen[(1, step)] for _, step in seen)  # bitwise identical replicas
    a, m = final_parameters(ada), final_parameters(mean)
    assert any(not np.allclose(a[n], m[n], rtol=1e-4, atol=1e-6) for n in a)  # Adasum really replaced the mean
    files = sorted(p.name for p in list_complete(ada.checkpoints_dir)[-1].path.glob("optimizer*.h5"))
    per_rank = optimizer["name"] != "sgd"
    assert files == (["optimizer-rank00000-of-00002.h5", "optimizer-rank00001-of-00002.h5"] if per_rank
                     else ["optimizer.h5"])


@pytest.mark.mpi
def test_adasum_adamw_killed_job_resumes_bitwise_with_per_rank_optimizer_states(adamw_steady):
    steady = adamw_steady[0]
    killed = make_run(steady.output_dir.parent, "killed", distributed=ADASUM, optimizer={"name": "adamw"}, **LONG)
    kill_and_resume(killed, min_step=40, end_step=200, timeout=300)
    a, b = final_parameters(steady), final_parameters(killed)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
