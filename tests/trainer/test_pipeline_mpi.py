"""Pipeline parallelism for real: a GPT split in 2 stages under ``mpiexec -n 2`` (and 2 x 2 under ``-n 4``)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from ortflow.checkpoints import list_complete, verify
from ortflow.checkpoints.h5state import params_files, stage_file
from ortflow.cli import app
from tests.support.mlp_stack import B, T, build_torchlike
from tests.support.parallel_runs import assert_export_equals_eval_graph, corpus, kill_after_first_checkpoint, losses
from tests.support.runs import (
    make_run,
    make_text_run,
    named_past_the_check,
    rank_command,
    run_ranks,
    run_ranks_together,
    start_ranks,
    start_script_ranks,
)

pytestmark = pytest.mark.mpi

TRAIN = {"batch_size": 2, "num_train_steps": 8, "gradient_accumulation_steps": 2, "evaluation_period": 2,
         "display_loss_steps": 1}
# Measured: the split trains to bitwise the same parameters as the unsplit model (max |diff| 0.0 after 4 AdamW
# updates; each stage's graph computes the same ops in the same order, and the micro-batch gradients are summed in the
# same order). The bound allows fp32 rounding only, in case another engine build fuses differently across a cut:
# AdamW's early steps move a weight by ~lr whatever its gradient's size, so a 1e-7 relative change in a gradient is
# at most ~lr * 1e-7 * steps in a weight; 1e-6 is far above that and far below one step's change (~1e-2).
ATOL = 1e-6


def torchlike_run(root, name, tied=False, **sections):
    """A run on the torch-export-shaped model (fixed batch 2, Shape/Reshape chains; LM head tied or its own)."""
    model = root / f"torchlike{'-tied' if tied else ''}.onnx"
    if not model.exists():
        build_torchlike(model, num_blocks=2, vocab=256, tied=tied)
    data = {"train": [str(corpus(root))], "format": "text", "text": {"seq_len": T}, "eval_fraction": 0.05}
    return make_run(root, name, model=model, data=data, train={**TRAIN, "batch_size": B, "max_eval_rows": B},
                    **sections)


def stage_parameters(cfg, checkpoint=None) -> dict[str, np.ndarray]:
    """Trainable parameters of the newest (or given) checkpoint: every stage's params file (or params.h5), merged;
    an artifacts folder's engine ``checkpoint`` (the initial weights) is read with the engine."""
    folder = checkpoint or list_complete(cfg.checkpoints_dir)[-1].path
    if (folder / "checkpoint").exists():
        from ortflow.engine import api

        state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        return {name: np.array(p.data) for name, p in state.parameters if p.requires_grad}
    merged = {}
    for file in params_files(folder):
        with h5py.File(file, "r") as f:
            for ds in f["parameters"].values():
                if ds.attrs["requires_grad"]:
                    merged.setdefault(str(ds.attrs["name"]), ds[()])
    return merged


def stage_files(num_stages: int) -> set[str]:
    """What a pipeline checkpoint folder holds: each stage's HDF5 files and meta.json."""
    kinds = ("params", "optimizer")
    return {"meta.json"} | {stage_file(kind, s, num_stages) for s in range(num_stages) for kind in kinds}


def digests(output: str) -> dict[tuple[int, int], str]:
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", output)
    return {(int(rank), int(step)): digest for rank, digest, step in found}


# 4 updates of 4 micro-batches (a stage in the middle of a 3-stage pipeline sees its steady state), an eval after 2.
SPLIT_TRAIN = {**TRAIN, "num_train_steps": 16, "gradient_accumulation_steps": 4}
# Below the measured norms (1.3-2.5), so every update of the 2- and 3-stage runs and of their reference clips by the
# global norm (summed over the stages). Unclipped stages against the unsplit run:
# test_two_stages_of_a_torch_shaped_model_train_to_the_unsplit_parameters.
CLIP = {"max_grad_norm": 0.5}


@pytest.fixture(scope="module")
def hung_stage(tmp_path_factory):
    """The 2-stage job whose stage 1 hangs in its first backward call (fault_stage.py), started with the module's
    first run (:func:`unsplit`): it waits out its collective timeout while the other runs train. The future of its
    output and the seconds it ran."""
    cfg = make_text_run(tmp_path_factory.mktemp("hang"), "hang", distributed={
        "num_ranks": 2, "pipeline_parallel_size": 2, "collective_timeout_s": 2.0}, train=TRAIN)
    return start_script_ranks(cfg, str(Path(__file__).with_name("fault_stage.py")), timeout=60)


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory, hung_stage):
    """One 1-rank run of the 1-layer GPT (SPLIT_TRAIN, every update clipped), the reference of the 2- and 3-stage
    runs; returns its config and the future of its output (it trains while the split runs configure). The hung-stage
    job starts first."""
    cfg = make_text_run(tmp_path_factory.mktemp("unsplit"), "pp1", distributed={"num_ranks": 1}, train=SPLIT_TRAIN,
                        optimizer=CLIP)
    return cfg, start_ranks(cfg)


@pytest.fixture(scope="module")
def staged(unsplit):
    """The 2- and 3-stage runs compared with :func:`unsplit`, by stage count: each config and the future of its
    output, configured at once and each started as soon as it is configured (independent jobs, side by side: no
    assertion depends on their order or speed)."""
    root, runs = unsplit[0].output_dir.parent, {}
    for stages in (2, 3):
        cfg = make_text_run(root, f"pp{stages}", distributed={"num_ranks": stages, "pipeline_parallel_size": stages},
                            train=SPLIT_TRAIN, optimizer=CLIP)
        runs[stages] = cfg, start_ranks(cfg, timeout=240)
    return runs


def test_two_stages_train_to_the_unsplit_parameters_with_every_update_clipped(unsplit, staged):
    unsplit, job = unsplit
    split, split_job = staged[2]
    out2, out1 = split_job.result(), job.result()
    assert out1.returncode == 0, out1.stdout
    assert out2.returncode == 0, out2.stdout
    p1, p2 = stage_parameters(unsplit), stage_parameters(split)
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    print("max |param diff| pp2 vs pp1:", worst)
    assert worst < ATOL
    np.testing.assert_allclose(losses(out2.stdout), losses(out1.stdout), rtol=1e-5)
    evals = [re.findall(r"eval_loss ([0-9.e+-]+)", out.stdout) for out in (out1, out2)]
    assert len(evals[1]) == 2 and evals[1] == evals[0]  # eval through the stages: the unsplit eval loss, as printed
    norms = [float(x) for x in re.findall(r"grad_norm ([0-9.e+-]+)", out2.stdout)]
    assert norms and min(norms) > CLIP["max_grad_norm"]  # every update really clipped
    folder = list_complete(split.checkpoints_dir)[-1].path
    assert {f.name for f in folder.iterdir()} == stage_files(2)
    assert set(verify(folder).meta["files"]) == stage_files(2) - {"meta.json"}  # every stage file, with its checksum


KEEP_ALL = {"period": 1, "max_num_checkpoints": 10}


@pytest.fixture(scope="module")
def tied_pp2(tmp_path_factory):
    """One finished pp 2 run of the tied torch-shaped model (a checkpoint after each of its 4 updates), shared by the
    split-equals-unsplit test (tied case) and the tied resume / checkpoint tools test."""
    cfg = torchlike_run(tmp_path_factory.mktemp("tied"), "pp2", True,
                        distributed={"num_ranks": 2, "pipeline_parallel_size": 2}, checkpoint=KEEP_ALL)
    out = run_ranks(cfg)
    assert out.returncode == 0, out.stdout
    return cfg


@pytest.mark.parametrize("tied", [False, True])
def test_two_stages_of_a_torch_shaped_model_train_to_the_unsplit_parameters(request, tmp_path, tied):
    # Tied: the embedding is read by stage 0 (Gather) and stage 1 (Transpose -> LM head). Each stage holds a copy; the
    # unsplit engine sums the two uses' gradients per micro-batch, the stages per stage and then across, so the sums
    # are grouped differently: equal to fp32 rounding, not bitwise (same bound as ATOL's reasoning).
    if tied:  # the shared tied run (its model file and data in its folder)
        split = request.getfixturevalue("tied_pp2")
        root = split.output_dir.parent
    else:
        root = tmp_path
        split = torchlike_run(root, "pp2", tied, distributed={"num_ranks": 2, "pipeline_parallel_size": 2})
    unsplit = torchlike_run(root, "pp1", tied, distributed={"num_ranks": 1})
    outs = run_ranks_together(unsplit, *([] if tied else [split]))  # independent jobs: at once
    for out in outs:
        assert out.returncode == 0, out.stdout
    p1, p2 = stage_parameters(unsplit), stage_parameters(split)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    print(f"tied={tied}: max |param diff| pp2 vs pp1: {worst}")
    assert worst < ATOL
    if tied:  # both stages' copies of the tied weight (each in its stage's file) are bitwise equal
        folder = list_complete(split.checkpoints_dir)[-1].path
        copies = []
        for file in params_files(folder):
            with h5py.File(file, "r") as f:
                copies += [ds[()] for ds in f["parameters"].values() if ds.attrs["name"] == "wte"]
        assert len(copies) == 2
        assert np.array_equal(copies[0], copies[1]) and not np.array_equal(copies[0], p1["wte"] * 0)


def test_three_stages_with_a_middle_stage_match_the_unsplit_parameters_with_every_update_clipped(unsplit, staged):
    # The middle stage both receives and sends (forward, recompute, VJP): 3 ranks, 4 micro-batches per update.
    unsplit, job = unsplit
    split, split_job = staged[3]
    out3 = split_job.result()
    assert job.result().returncode == 0, job.result().stdout
    assert out3.returncode == 0, out3.stdout
    p1, p3 = stage_parameters(unsplit), stage_parameters(split)
    assert max(float(np.abs(p1[n] - p3[n]).max()) for n in p1) < ATOL
    norms = [float(x) for x in re.findall(r"grad_norm ([0-9.e+-]+)", out3.stdout)]
    assert norms and min(norms) > CLIP["max_grad_norm"]  # the norm summed over 3 stages, every update clipped
    folder = list_complete(split.checkpoints_dir)[-1].path
    assert {f.name for f in folder.iterdir()} == stage_files(3)


def test_two_stages_by_two_replicas_match_and_replicas_are_bitwise_identical(tmp_path):
    # 4 ranks on the CI machine's 2 cores: tiny model, 2 updates.
    train = {**TRAIN, "num_train_steps": 4, "evaluation_period": 0}
    unsplit = make_text_run(tmp_path, "dp2", distributed={"num_ranks": 2}, train=train)
    grid = make_text_run(tmp_path, "pp2dp2", distributed={"num_ranks": 4, "pipeline_parallel_size": 2}, train=train)
    out1, out4 = run_ranks_together(unsplit, grid, timeout=240)
    assert out1.returncode == 0, out1.stdout
    assert out4.returncode == 0, out4.stdout
    p1, p4 = stage_parameters(unsplit), stage_parameters(grid)
    assert max(float(np.abs(p1[n] - p4[n]).max()) for n in p1) < ATOL
    seen = digests(out4.stdout)  # rank = replica * 2 + stage: ranks 0, 2 hold stage 0; ranks 1, 3 stage 1
    assert seen[(0, 2)] == seen[(2, 2)] and seen[(1, 2)] == seen[(3, 2)] and seen[(0, 2)] != seen[(1, 2)]


# 20 updates, a checkpoint after each: enough that the kill below lands mid-run even when the poll is slow (with 4
# the run could finish between two polls on a loaded machine).
PP2_UPDATES = 20
PP2 = {"distributed": {"num_ranks": 2, "pipeline_parallel_size": 2},
       "train": {**TRAIN, "num_train_steps": 2 * PP2_UPDATES, "evaluation_period": 0},
       "checkpoint": {"period": 1, "max_num_checkpoints": PP2_UPDATES + 1}}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One finished pp 2 run (4 updates, a checkpoint after each), shared by the kill/resume, export and refusal
    tests: the uninterrupted reference, the run exported, and the checkpoint another stage count must refuse."""
    cfg = make_text_run(tmp_path_factory.mktemp("pp2"), "straight", **PP2)
    out = run_ranks(cfg)
    assert out.returncode == 0, out.stdout
    return cfg


def test_kill_and_resume_is_bitwise_identical(tmp_path, straight):
    resumed = make_text_run(straight.output_dir.parent, "resumed", **PP2)
    done = kill_after_first_checkpoint(resumed)
    assert done and done[-1] < PP2_UPDATES, done
    out = run_ranks(resumed)
    assert out.returncode == 0, out.stdout
    assert f"starting from step {done[-1]}" in out.stdout
    a, b = stage_parameters(straight), stage_parameters(resumed)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_export_stitches_the_stages_into_the_unsplit_eval_graph(tmp_path, straight):
    from ortflow.export.model import export_model

    split = straight
    out = tmp_path / "model.onnx"
    result = export_model(split.output_dir, out, config=split)
    assert max(result.verification.max_abs_diff.values()) <= 1e-5
    # Independently: the exported model equals the unsplit eval graph fed with every stage's trained parameters.
    params = stage_parameters(split)
    assert_export_equals_eval_graph(split, out, params, seq=16)
    initial = stage_parameters(split, split.artifacts_dir)  # artifacts/checkpoint: the unsplit initial weights
    assert any(not np.array_equal(initial[n], params[n]) for n in params)  # trained, not the initial weights


def test_a_hung_stage_is_named_when_its_neighbour_times_out(hung_stage):
    out, seconds = hung_stage.result()
    assert out.returncode != 0
    assert "'recv grad mb0 <- stage 1' waited" in out.stdout, out.stdout
    assert "stalled: rank 1 (last entered" in out.stdout, out.stdout
    assert seconds < 40


def test_resuming_with_another_stage_count_is_refused_with_the_fix(tmp_path, straight):
    folder = next(c.path for c in list_complete(straight.checkpoints_dir) if c.step == 1)  # a pp 2 checkpoint
    unsplit = named_past_the_check(make_text_run(tmp_path, "pp1", distributed={"num_ranks": 1},
                                                 train={**TRAIN, "num_train_steps": 4}),
                                   folder, "was written with distributed.pipeline_parallel_size 2 but this run has 1")
    out = run_ranks(unsplit)
    assert out.returncode != 0
    assert "was written with distributed.pipeline_parallel_size 2 but this run has 1" in out.stdout, out.stdout
    # The way out names this config's own fix: the same checkpoint as a warm start (which stitches the stages).
    assert f"checkpoint.init_from: {folder} in place of checkpoint.checkpoint_to_load_path" in out.stdout, out.stdout
    # `ortflow train` refuses it before it starts a job: no layout chosen, no rank started.
    result = CliRunner().invoke(app, ["train", str(unsplit.output_dir)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert "was written with distributed.pipeline_parallel_size 2 but this run has 1" in result.output, result.output
    assert "layout:" not in result.output and "[0]" not in result.output, result.output
    assert "Traceback" not in out.stdout, out.stdout  # one line naming the fix, which a retry would meet again


def test_a_stop_signal_on_one_stage_stops_every_stage_at_the_same_update(tmp_path):
    from ortflow.trainer.metrics import read_progress

    cfg = make_text_run(tmp_path, "stop", distributed={"num_ranks": 2, "pipeline_parallel_size": 2},
                        train={**TRAIN, "num_train_steps": 4000, "evaluation_period": 0},
                        checkpoint={"period": 1000, "max_num_checkpoints": 2})
    proc = subprocess.Popen(rank_command(cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and ((read_progress(cfg.output_dir) or {}).get("step") or 0) < 3:
        time.sleep(0.05)
    ranks = subprocess.run(["pgrep", "-f", f"ortflow.trainer {cfg.output_dir}"], capture_output=True, text=True)
    pids = sorted(int(p) for p in ranks.stdout.split()
                  if Path(f"/proc/{p}/comm").read_text().startswith("python"))  # not mpiexec or its proxy
    assert len(pids) == 2, ranks.stdout
    subprocess.run(["kill", "-TERM", str(pids[-1])], check=True)  # one rank only: the stop flag must spread
    output, _ = proc.communicate(timeout=120)
    stopped = {int(step) for step in re.findall(r"ranks stopped together after step (\d+)", output)}
    assert len(stopped) == 1 and output.count("ranks stopped together") == 2, output[-3000:]
    (step,) = stopped
    kept = list_complete(cfg.checkpoints_dir)
    assert kept[-1].step == step < 2000
    verify(kept[-1].path)


def test_tied_weights_resume_bitwise_and_the_checkpoint_tools_read_the_stage_files(tmp_path, tied_pp2):
    # The tied embedding sits in both stages' files (params and optimizer state): resume reads each stage's part by
    # name (the duplicate once), and inspect/merge stitch the stages into the whole model's parameters and moments.
    from ortflow.checkpoints.tools import inspect, merge

    dist = {"num_ranks": 2, "pipeline_parallel_size": 2}
    straight = tied_pp2
    middle = next(c.path for c in list_complete(straight.checkpoints_dir) if c.step == 2)
    resumed = torchlike_run(straight.output_dir.parent, "resumed", True, distributed=dist,
                            checkpoint={**KEEP_ALL, "checkpoint_to_load_path": str(middle)})
    out = run_ranks(resumed)
    assert out.returncode == 0, out.stdout
    assert "starting from step 2" in out.stdout
    a, b = stage_parameters(straight), stage_parameters(resumed)
    assert sorted(a) == sorted(b) and "wte" in a
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    final = list_complete(straight.checkpoints_dir)[-1].path
    summary = inspect(final)
    assert summary["optimizer_files"] == [stage_file("optimizer", s, 2) for s in (0, 1)]
    assert summary["optimizer_state"] == ["exp_avg", "exp_avg_sq"] and summary["optimizer_step_count"] == 4
    assert set(summary["parameters"]) >= set(a)
    merged = tmp_path / "merged.h5"
    merge(final, merged)  # each state tensor whole: the tied one's duplicate piece is not counted twice
    with h5py.File(merged, "r") as f:
        assert np.array_equal(f["parameters"]["wte"][()], a["wte"])
        assert f["optimizer"]["exp_avg"]["wte"].shape == a["wte"].shape


def step_losses(output: str) -> dict[int, float]:
    """Rank 0's training loss of each update it logged, by step."""
    return {int(step): float(loss) for step, loss in re.findall(r"INFO step (\d+)/\d+ \| loss ([0-9.e+-]+)", output)}


# The attention key bias adds the same q.b to every score of a query's row, which the softmax cancels: its gradient is
# zero up to rounding, and AdamW scales that rounding noise (which the summation order changes) into steps of ~1e-5,
# so its trained value is noise on any layout (measured 1.4e-5 apart between pp 2 x dp 1 and pp 2 x dp 2).
KEY_BIAS = "h0.attn.k.bias"


def test_a_pipeline_checkpoint_resumes_on_another_data_parallel_size_at_the_same_global_batch(tmp_path):
    # pp 2 x dp 1 (2 ranks) and pp 2 x dp 2 (4 ranks) at the same global batch: 8 samples per update, 4 micro-batches
    # of 2 on the one replica, 2 on each of two. Each run's step-1 checkpoint resumes on the other rank count.
    train = {"batch_size": 2, "global_batch_size": 8, "num_train_steps": 3, "evaluation_period": 0,
             "display_loss_steps": 1}
    refs = {dp: make_text_run(tmp_path, f"pp2dp{dp}", train=train, checkpoint=KEEP_ALL,
                              distributed={"num_ranks": 2 * dp, "pipeline_parallel_size": 2}) for dp in (1, 2)}
    ref_outs = dict(zip(refs, run_ranks_together(*refs.values(), timeout=240), strict=True))
    for out in ref_outs.values():
        assert out.returncode == 0, out.stdout
    resumed = {}  # by the data-parallel size it resumes on, from the other size's checkpoint
    for dp, other in ((2, 1), (1, 2)):
        start = next(c.path for c in list_complete(refs[other].checkpoints_dir) if c.step == 1)
        resumed[dp] = make_text_run(tmp_path, f"dp{other}to{dp}", train=train,
                                    checkpoint={**KEEP_ALL, "checkpoint_to_load_path": str(start)},
                                    distributed={"num_ranks": 2 * dp, "pipeline_parallel_size": 2})
    outs = dict(zip(resumed, run_ranks_together(*resumed.values(), timeout=240), strict=True))
    for dp, run in resumed.items():
        out, ref, ref_out = outs[dp], refs[dp], ref_outs[dp]
        assert out.returncode == 0, out.stdout
        assert "starting from step 1" in out.stdout, out.stdout
        assert "samples per weight update" not in out.stdout, out.stdout  # the same 8 samples per update
        last, ref_last = list_complete(run.checkpoints_dir)[-1], list_complete(ref.checkpoints_dir)[-1]
        assert last.step == ref_last.step == 3
        assert last.global_cursor == ref_last.global_cursor == 3 * 8  # continued at the exact sample
        assert {f.name for f in last.path.iterdir()} == stage_files(2)
        # The uninterrupted run of the layout it resumed on, to fp32 summation order (docs/reliability.md, as
        # tests/launch/test_layout_mpi.py bounds a global batch on another rank count): the updates read the same
        # samples, and only how the micro-batch gradients are grouped (accumulated on one replica, or over two and
        # then averaged) differs.
        got, want = step_losses(out.stdout), step_losses(ref_out.stdout)
        assert sorted(got) == [2, 3] and sorted(want) == [1, 2, 3], out.stdout
        np.testing.assert_allclose([got[s] for s in (2, 3)], [want[s] for s in (2, 3)], rtol=2e-6)
        p, q = stage_parameters(run), stage_parameters(ref)
        assert sorted(p) == sorted(q) and KEY_BIAS in q
        # Every parameter within the file's fp32-rounding bound (measured: at most 5.2e-7, a rarely seen token's
        # lm_head weight, whose small gradient AdamW's first steps normalise).
        worst = max(float(np.abs(p[n] - q[n]).max()) for n in p if n != KEY_BIAS)
        print(f"resumed on dp {dp}: max |param diff| {worst}, key bias {np.abs(p[KEY_BIAS] - q[KEY_BIAS]).max()}")
        assert worst < ATOL
        # The key bias: noise on both sides, far below the ~3e-2 the other biases move in 3 updates.
        assert max(float(np.abs(p[KEY_BIAS]).max()), float(np.abs(q[KEY_BIAS]).max())) < 1e-4
    initial = stage_parameters(refs[1], refs[1].artifacts_dir)
    assert any(not np.array_equal(initial[n], stage_parameters(refs[1])[n]) for n in initial)  # it trained
