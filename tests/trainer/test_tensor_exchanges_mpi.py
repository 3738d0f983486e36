"""ZeRO-1 and Adasum over the replicas of tensor-parallel ranks (tp 2 x dp 2 under ``mpiexec -n 4``; Adasum also
pp 2 x tp 2 x dp 2 under ``-n 8``) against the same exchange over unsplit replicas (dp 2): the split ends where the
unsplit run ends, its checkpoint holds each replica's optimizer file per tensor-parallel rank, the merged optimizer
state equals the unsplit run's, and a killed ZeRO-1 run resumes bitwise from its replicas' shards."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow.checkpoints import h5state
from ortflow.checkpoints.h5state import read_params
from ortflow.checkpoints.tp import tp_shard_file
from tests.support.parallel_runs import (
    gpt_run,
    h5_arrays,
    initial_parameters,
    kill_after_first_checkpoint,
    losses,
    newest,
)
from tests.support.runs import copied_run, run_ranks, run_ranks_together
from tests.trainer.test_tensor_mpi import ATOL

pytestmark = pytest.mark.mpi

# The tensor split's own rounding (test_tensor_mpi.ATOL: its row-split partial sums are added after the local dot
# products) is what separates the runs; the exchange adds none of its own beyond the norm's float32 chunk sums
# (ZeRO-1's ranges, Adasum's coefficients from the slices' dot products added over the tp ranks in float64). A wrong
# exchange (a shard or coefficient of the wrong slice, a replicated tensor counted twice) moves weights by ~lr.
EXCHANGES = {"zero1": {"zero_stage": 1}, "adasum": {"enable_adasum": True}}
CLIP = 0.05  # below the measured norms: every update clips by the global norm, which the ranks must agree on


EVERY = {"period": 1, "max_num_checkpoints": 10}
# No evaluation: these tests compare parameters, losses, norms and optimizer state (evaluation through tensor pieces
# and stages: test_tensor_mpi.py, test_pipe_tensor_mpi.py).
NO_EVAL = {"evaluation_period": 0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The runs of each exchange, made once for every test that asks (:func:`runs_of`)."""
    return {"factory": tmp_path_factory}


def runs_of(trained: dict, name: str):
    """The dp 2 run and the dp 2 x tp 2 run of one exchange (AdamW, the same samples, a checkpoint every update)."""
    if name not in trained:
        exchange = EXCHANGES[name]
        root = trained["factory"].mktemp(name)
        opt = {"name": "adamw", "max_grad_norm": CLIP}
        done = [trained[other] for other in EXCHANGES if other in trained]

        def make(run_name: str, index: int, **sections):
            # the other exchange's runs hold the same artifacts, configured from the same model file
            if not done:
                return gpt_run(root, run_name, **sections)
            return copied_run(done[0][index], gpt_run, root, run_name, model_path=done[0][index].model.path,
                              **sections)

        whole = make("dp2", 1, distributed={"num_ranks": 2, **exchange}, optimizer=opt, checkpoint=EVERY, train=NO_EVAL)
        split = make("dp2tp2", 2, distributed={"num_ranks": 4, "horizontal_parallel_size": 2, **exchange},
                     optimizer=opt, checkpoint=EVERY, train=NO_EVAL)
        out1, out2 = run_ranks_together(whole, split, timeout=300)  # independent jobs: at once
        assert out1.returncode == 0, out1.stdout[-3000:]
        assert out2.returncode == 0, out2.stdout[-3000:]
        trained[name] = (name, whole, split, out1, out2)
    return trained[name]


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_tensor_parallel_replicas_match_the_same_exchange_over_unsplit_replicas(trained, exchange):
    name, whole, split, out1, out2 = runs_of(trained, exchange)
    p1, p2 = read_params(newest(whole)), read_params(newest(split))  # the split one's slices merged
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    initial = initial_parameters(whole)
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"{name}: max |param diff| dp 2 x tp 2 vs dp 2: {worst}; largest move in training {moved}")
    assert worst < ATOL["adamw"] and moved > 10 * ATOL["adamw"]
    np.testing.assert_allclose(losses(out2.stdout), losses(out1.stdout), rtol=1e-5)
    norms = [[float(x) for x in re.findall(r"grad_norm ([0-9.e+-]+)", o.stdout)] for o in (out1, out2)]
    assert norms[1] and max(norms[1]) > CLIP  # clipped by a norm the ranks agreed on (else the digests differ)
    np.testing.assert_allclose(norms[1], norms[0], rtol=1e-4)


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
def test_each_replica_writes_its_optimizer_file_per_tensor_parallel_rank_and_they_merge(trained, exchange):
    name, whole, split, _, _ = runs_of(trained, exchange)
    folder = newest(split)
    assert sorted(f.name for f in folder.glob("optimizer*.h5")) == sorted(
        tp_shard_file(t, 2, None, r, 2) for t in range(2) for r in range(2))
    # The merged state (ZeRO-1: each slice's replica shards stitched; Adasum: replica 0's own moments) against the
    # unsplit run's (its rank 0's under Adasum), moment by moment.
    step1, _, whole_pieces = h5state.state_pieces(newest(whole), rank=0)
    step2, _, split_pieces = h5state.state_pieces(folder)
    assert step1 == step2 == 4
    assert sorted(split_pieces) == sorted(whole_pieces)
    for sname, pieces in whole_pieces.items():
        values, merged = _stitched(pieces), _stitched(split_pieces[sname])
        assert sorted(merged) == sorted(values)
        scale = max(float(np.abs(v).max()) for v in values.values())
        worst = max(float(np.abs(values[p] - merged[p].reshape(-1)).max()) for p in values)
        print(f"{name} {sname}: max |diff| {worst} of {scale}")
        assert worst <= 1e-3 * scale


def test_adasum_over_pp2_x_tp2_replicas_matches_adasum_over_unsplit_replicas(trained):
    """The one 8-rank run (dp 2 x pp 2 x tp 2): Adasum's coefficients from slices summed over a stage's tp group, its
    per-replica norm summed over the replica's stages and tp ranks, a tied weight summed across stages first."""
    _, whole, _, _, _ = runs_of(trained, "adasum")
    split = gpt_run(whole.output_dir.parent, "dp2pp2tp2", optimizer={"name": "adamw", "max_grad_norm": CLIP},
                    train=NO_EVAL,
                    distributed={"num_ranks": 8, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2,
                                 **EXCHANGES["adasum"]})
    out = run_ranks(split, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    p1, p2 = read_params(newest(whole)), read_params(newest(split))
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    print(f"adasum: max |param diff| dp 2 x pp 2 x tp 2 vs dp 2: {worst}")
    assert sorted(p1) == sorted(p2) and worst < ATOL["adamw"]
    assert len(list(newest(split).glob("optimizer-stage*-tp*-rank*.h5"))) == 8  # each replica of each (stage, slice)


def test_a_killed_zero1_tensor_parallel_run_resumes_bitwise_from_its_replicas_shards(trained):
    _, _, straight, _, _ = runs_of(trained, "zero1")
    resumed = copied_run(straight, gpt_run, straight.output_dir.parent, "resumed",
                         optimizer={"name": "adamw", "max_grad_norm": CLIP},
                         distributed={"num_ranks": 4, "horizontal_parallel_size": 2, **EXCHANGES["zero1"]},
                         checkpoint=EVERY, train=NO_EVAL)
    done = kill_after_first_checkpoint(resumed)
    assert done and done[-1] < 4, done
    out = run_ranks(resumed, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"starting from step {done[-1]}" in out.stdout
    a, b = newest(straight), newest(resumed)
    names = sorted(f.name for f in a.glob("*.h5"))
    assert names == sorted(f.name for f in b.glob("*.h5")) and len(names) == 6  # 2 params + 4 optimizer shards
    for name in names:  # every rank's own files, bit for bit
        assert h5_arrays(a / name) == h5_arrays(b / name), name


def _stitched(pieces) -> dict[str, np.ndarray]:
    """Each parameter's state whole from its ``(name, lo, hi, values)`` pieces (ranges that follow each other)."""
    whole: dict[str, np.ndarray] = {}
    for param, lo, hi, array in sorted(pieces, key=lambda p: (p[0], p[1])):
        before = whole.get(param, np.zeros(0, np.float32))
        assert before.size == lo and array.size == hi - lo, (param, lo, hi, before.size)  # no gap, no overlap
        whole[param] = np.concatenate([before, array.reshape(-1)])
    return whole
