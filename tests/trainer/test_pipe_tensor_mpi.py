"""Pipeline x tensor parallelism for real: a 2-layer GPT in 2 stages x 2 tensor-parallel ranks (``mpiexec -n 4``).

One pp 2 x tp 2 run (checkpoint every update) is shared by the tests: against the unsplit run, against a second
run killed and resumed, and through merge and export.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from ortflow.checkpoints.tp import tp_file
from tests.support.parallel_runs import (
    EVERY,
    assert_export_equals_eval_graph,
    gpt_run,
    h5_arrays,
    initial_parameters,
    kill_after_first_checkpoint,
    losses,
    newest,
)
from tests.support.runs import copied_run, run_ranks, run_ranks_together
from tests.trainer.test_tensor_mpi import ATOL, digests

pytestmark = pytest.mark.mpi

PP_TP = {"num_ranks": 4, "horizontal_parallel_size": 2, "pipeline_parallel_size": 2}
FILES = {tp_file(kind, t, 2, (s, 2)) for kind in ("params", "optimizer") for s in range(2) for t in range(2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gpt_unsplit):
    """The unsplit run (the session's, shared with test_tensor_mpi.py: tests/trainer/conftest.py) and the pp 2 x tp 2
    run (AdamW, 4 updates of 2 micro-batches, the same samples)."""
    root = tmp_path_factory.mktemp("pptp")
    whole, job = gpt_unsplit
    split = gpt_run(root, "pp2tp2", distributed=PP_TP, checkpoint=EVERY)
    out2 = run_ranks(split, timeout=300)
    out1 = job.result()
    assert out1.returncode == 0, out1.stdout[-3000:]
    assert out2.returncode == 0, out2.stdout[-3000:]
    return root, whole, split, out1, out2


def test_pp2_tp2_trains_to_the_unsplit_parameters_and_tp_ranks_agree(runs):
    _, whole, split, out1, out2 = runs
    p1, p2 = read_params(newest(whole)), read_params(newest(split))  # every stage's slices merged
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    initial = initial_parameters(whole)
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"pp 2 x tp 2, adamw: max |param diff| vs pp 1 x tp 1: {worst}; largest move in training {moved}")
    # The tolerance of tp 2 alone (test_tensor_mpi.ATOL): the stage cut adds no rounding of its own (pp 2 is bitwise
    # equal to pp 1), the tensor split's row-parallel partial sums do.
    assert worst < ATOL["adamw"] and moved > 10 * ATOL["adamw"]
    np.testing.assert_allclose(losses(out2.stdout), losses(out1.stdout), rtol=1e-5)
    evals = [[float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", o.stdout)] for o in (out1, out2)]
    assert len(evals[1]) == 2
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)  # eval forward through the stages and their pieces
    seen = digests(out2.stdout)  # rank = stage * 2 + t
    assert sorted(seen) == [0, 1, 2, 3]
    assert seen[0][1] == seen[1][1] and seen[2][1] == seen[3][1]  # replicated parameters: bitwise equal in a stage
    assert seen[0][1] != seen[2][1]  # the stages hold different parameters
    assert seen[0][0] != seen[1][0]  # and the tp ranks different slices
    assert {f.name for f in newest(split).iterdir()} == {"meta.json"} | FILES


def test_kill_and_resume_is_bitwise_identical(runs):
    root, _, straight, _, _ = runs
    resumed = copied_run(straight, gpt_run, root, "resumed", distributed=PP_TP, checkpoint=EVERY)
    done = kill_after_first_checkpoint(resumed)
    assert done and done[-1] < 4, done
    out = run_ranks(resumed, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"starting from step {done[-1]}" in out.stdout
    folder = newest(resumed)
    assert {f.name for f in folder.iterdir()} == {"meta.json"} | FILES
    for name in sorted(FILES):  # every (stage, tp rank)'s own files, bit for bit
        assert h5_arrays(newest(straight) / name) == h5_arrays(folder / name), name


def test_merge_rebuilds_whole_tensors_and_export_equals_the_unsplit_eval_graph(runs):
    import h5py

    from ortflow.checkpoints.tools import merge
    from ortflow.export.model import export_model

    root, _, split, _, _ = runs
    folder = newest(split)
    with h5py.File(folder / tp_file("params", 1, 2, (1, 2)), "r") as f:  # stage 1, tp rank 1: half of h1's MLP
        names = {ds.attrs["name"]: ds for ds in f["parameters"].values()}
        assert names["h1.mlp.fc.weight"].shape == (32, 64) and "h0.attn.q.weight" not in names
    params = read_params(folder)
    assert params["h0.attn.q.weight"].shape == (32, 32) and params["h1.mlp.proj.weight"].shape == (128, 32)
    merged = merge(folder, root / "merged.h5")
    assert merged.step == 4
    with h5py.File(root / "merged.h5", "r") as f:
        whole = {ds.attrs["name"]: ds[()] for ds in f["parameters"].values()}
        moments = {ds.attrs["name"]: ds[()] for ds in f["optimizer"]["exp_avg"].values()}
    assert sorted(whole) == sorted(params) and all(np.array_equal(whole[n], params[n]) for n in params)
    assert moments["h1.mlp.fc.weight"].shape == (32, 128) and np.abs(moments["h0.mlp.fc.weight"]).max() > 0
    out = root / "model.onnx"
    result = export_model(split.output_dir, out, config=split)
    assert max(result.verification.max_abs_diff.values()) <= 1e-5
    # Independently: the exported model equals the unsplit eval graph fed with the merged trained parameters.
    assert_export_equals_eval_graph(split, out, params)
    initial = initial_parameters(split)
    assert any(not np.array_equal(initial[n], params[n]) for n in params)  # trained, not the initial weights


@pytest.mark.slow
def test_dp2_pp2_tp2_on_8_ranks_trains_to_the_dp2_parameters_with_identical_replicas(tmp_path, runs):
    opt = {"name": "sgd", "learning_rate": 1e-2}
    _, configured_whole, configured_split, _, _ = runs  # the same model and split: their artifacts, copied
    whole = copied_run(configured_whole, gpt_run, tmp_path, "dp2", distributed={"num_ranks": 2}, optimizer=opt)
    split = copied_run(configured_split, gpt_run, tmp_path, "dp2pp2tp2", distributed={**PP_TP, "num_ranks": 8},
                       optimizer=opt)
    out1, out2 = run_ranks_together(whole, split, timeout=400)
    assert out1.returncode == 0, out1.stdout[-3000:]
    assert out2.returncode == 0, out2.stdout[-3000:]
    p1, p2 = read_params(newest(whole)), read_params(newest(split))
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    moved = max(float(np.abs(p1[n] - initial_parameters(whole)[n]).max()) for n in p1)
    print(f"dp 2 x pp 2 x tp 2, sgd: max |param diff| vs dp 2: {worst}; largest move in training {moved}")
    assert worst < ATOL["sgd"] and moved > 10 * ATOL["sgd"]
    seen = digests(out2.stdout)  # rank = (replica * 2 + stage) * 2 + t
    assert sorted(seen) == list(range(8))
    assert all(seen[r] == seen[r + 4] for r in range(4))  # each (stage, tp slice) bitwise equal on its replicas
    assert seen[0][1] == seen[1][1] != seen[2][1] == seen[3][1]  # replicated parameters: per stage
