"""Pipeline stages on GPUs (skipped without 2 GPUs, the GPU engine and CuPy).

Stages pass activations and gradients device to device over NCCL (one 2-rank communicator and one stream per direction
between neighbouring stages, the headers over the process group; ortflow.trainer.comm.device_pipe.DevicePipe): each rank
logs how many messages went that way, which the tests read; the replicas of a stage average their gradients with NCCL. A
tied table's gradients are summed over the process group through the host, as on CPU ranks.

By default (``recompute_forward: auto``) a GPU stage that is not the last runs each micro-batch's forward once and
keeps its activations until the backward, as CPU stages do (the engine on a stream the rank owns: the rank logs
"forward once, activations kept until the backward"); with ``recompute_forward: true`` it runs its forward again
inside its backward call ("forward recomputed inside the backward call"); a stage with a BatchNorm before its cut
recomputes its forward either way.

Tolerance against the unsplit model on one GPU: the CUDA provider runs matmuls in TF32 by default (10-bit mantissa,
relative error ~5e-4 per product). Each stage runs the unsplit graph's operators on the same micro-batch shapes, so
cuBLAS picks the same kernels and the runs may well agree bit for bit; but the engine's CUDA fusions see a stage's
graph, not the whole one, and may group the operators next to a cut differently, which moves results by TF32
rounding, not fp32 rounding. AdamW turns a gradient difference of that size into parameter differences far below one
learning-rate step (0.01 here), as for data-parallel GPUs (test_gpu_training.py): atol 1e-3 (a tenth of a step)
and rtol 1e-3. The ranks of one stage must stay bitwise identical (the trainer itself raises if their sha256 differ;
the 4-GPU test checks the logged digests too).

Run with ``-s`` to see each stage's median update time and idle share (the trainer logs them at the end of a run).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow import cuda_libs
from tests.gpu.test_gpu_training import REASON, _digests, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

# A hang (a lost NCCL message) is named by the watchdog within 60 s, before _run's 180 s subprocess timeout.
GPU = {"device": "cuda", "use_nccl": True, "collective_timeout_s": 60.0}
KEPT = "rank 0 stage 0: forward once, activations kept until the backward"
RECOMPUTED = "rank 0 stage 0: forward recomputed inside the backward call"
NCCL_MESSAGES = re.compile(r"rank (\d+) stage (\d+) pipeline messages over NCCL, device to device: (\d+) sent "
                           r"\(([0-9.]+) MiB\), (\d+) received \(([0-9.]+) MiB\)")
TIMING = re.compile(r"rank (\d+) stage (\d+)/(\d+) timing: median update ([0-9.]+) s, engine calls ([0-9.]+) s, "
                    r"idle ([0-9.]+)")


def _stage_timing(output: str) -> dict[int, tuple[int, float, float, float]]:
    """rank -> (stage, update s, engine s, idle) from the trainer's end-of-run log lines (printed for the record)."""
    found = {int(r): (int(s), float(t), float(e), float(i)) for r, s, _, t, e, i in TIMING.findall(output)}
    for rank, (stage, step_s, busy_s, idle) in sorted(found.items()):
        print(f"pp on GPUs: rank {rank} stage {stage}: median update {step_s * 1e3:.2f} ms, engine calls "
              f"{busy_s * 1e3:.2f} ms, idle {idle:.2f}")
    return found


def _nccl_messages(output: str) -> dict[int, tuple[int, int, int]]:
    """rank -> (stage, messages sent, messages received) over NCCL, from the stages' end-of-run log lines."""
    return {int(r): (int(s), int(sent), int(got)) for r, s, sent, _, got, _ in NCCL_MESSAGES.findall(output)}


def _compare(split, unsplit) -> float:
    from tests.trainer.test_pipeline_mpi import stage_parameters

    p1, p2 = stage_parameters(unsplit), stage_parameters(split)
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    print(f"pp on GPUs: max |parameter difference| vs unsplit {worst:.3g}")
    for name in p1:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-3, atol=1e-3, err_msg=name)
    return worst


@pytest.mark.parametrize("recompute_forward", ["auto", True])
def test_two_gpu_stages_with_eight_micro_batches_match_one_gpu(tmp_path, recompute_forward):
    """8 micro-batches per update: 1F1B keeps up to 2 in flight on stage 0, so activations and gradients of different
    micro-batches cross between the stages in both directions at once (which stalls where one NCCL stream carries both
    directions: tests/trainer/test_device_pipe_order.py); stage 0 keeps its activations (auto, the default) or
    recomputes its forward (true)."""
    from tests.support.runs import make_text_run
    from tests.trainer.test_pipeline_mpi import TRAIN

    train = {**TRAIN, "num_train_steps": 32, "gradient_accumulation_steps": 8}
    one = make_text_run(tmp_path, "one", distributed={**GPU, "num_ranks": 1}, train=train)
    two = make_text_run(tmp_path, "two", distributed={**GPU, "num_ranks": 2, "pipeline_parallel_size": 2,
                                                      "recompute_forward": recompute_forward}, train=train)
    _run(one, 1)
    log = _run(two, 2)
    assert "rank 0/2 (local 0/2) on cuda:0" in log and "rank 1/2 (local 1/2) on cuda:1" in log, log[-3000:]
    assert "rank 0: pipeline stage 0/2" in log and "rank 1: pipeline stage 1/2" in log, log[-3000:]
    expected, other = (RECOMPUTED, KEPT) if recompute_forward is True else (KEPT, RECOMPUTED)
    assert expected in log and other not in log, log[-3000:]
    _compare(two, one)
    timing = _stage_timing(log)
    assert sorted(s for s, *_ in timing.values()) == [0, 1], log[-3000:]
    assert all(0 < busy <= step for _, step, busy, _ in timing.values())
    assert len(re.findall(r"eval_loss ([0-9.e+-]+)", log)) == 2  # eval after updates 2 and 4, through both stages
    # Every activation and gradient went GPU to GPU over NCCL: one per micro-batch each way (num_train_steps counts
    # micro-batches), and the eval batches forward.
    messages = _nccl_messages(log)
    assert sorted(messages) == [0, 1], log[-3000:]
    micro_batches = train["num_train_steps"]
    assert messages[1][1] == micro_batches and messages[0][2] == micro_batches  # the gradients back: training only
    assert messages[0][1] == messages[1][2] > micro_batches  # the activations forward: training and eval batches


@pytest.mark.skipif(cuda_libs.gpu_count()[0] < 4, reason="pp 2 x dp 2 needs 4 GPUs")
def test_four_gpus_two_stages_by_two_replicas_match_and_replicas_are_identical(tmp_path):
    from tests.support.runs import make_text_run
    from tests.trainer.test_pipeline_mpi import TRAIN

    train = {**TRAIN, "num_train_steps": 4, "evaluation_period": 0}
    dp = make_text_run(tmp_path, "dp2", distributed={**GPU, "num_ranks": 2}, train=train)
    grid = make_text_run(tmp_path, "pp2dp2", distributed={**GPU, "num_ranks": 4, "pipeline_parallel_size": 2},
                         train=train)
    _run(dp, 2)
    log = _run(grid, 4)
    assert KEPT in log and "rank 2 stage 0: forward once, activations kept until the backward" in log, log[-3000:]
    assert sorted(_nccl_messages(log)) == [0, 1, 2, 3], log[-3000:]  # each replica's stages over NCCL
    _compare(grid, dp)
    seen = _digests(log)  # rank = replica * 2 + stage: ranks 0, 2 hold stage 0; ranks 1, 3 stage 1
    last = max(step for _, step in seen)
    assert seen[(0, last)] == seen[(2, last)] and seen[(1, last)] == seen[(3, last)], seen
    assert seen[(0, last)] != seen[(1, last)]
    _stage_timing(log)


def test_gpt2_export_with_its_tied_table_in_two_stages_on_two_gpus_equals_two_cpu_ranks(tmp_path):
    """The Hugging Face GPT-2 export's token table is read by the embedding (stage 0) and the LM head (stage 1): each
    stage holds a copy, and the two GPUs add their gradients of it through the host in stage order, as CPU ranks do.
    SGD and strict fp32 (the reasons in test_gpu_four_layouts.py) make the layouts comparable to 1e-6."""
    import h5py

    from ortflow.checkpoints import list_complete
    from ortflow.checkpoints.h5state import params_files
    from tests.gpu.test_gpu_four_layouts import SGD, STRICT_FP32, _compare
    from tests.support.parallel_runs import initial_parameters
    from tests.trainer.exports_runs import gpt2_run
    from tests.trainer.test_pipeline_mpi import stage_parameters

    layout, train = {"num_ranks": 2, "pipeline_parallel_size": 2}, {"num_train_steps": 8}
    gpu = gpt2_run(tmp_path, "gpu", distributed={**layout, **GPU, "recompute_forward": False}, optimizer=SGD,
                   train=train)  # stage 0 keeps its activations on its GPU
    cpu = gpt2_run(tmp_path, "cpu", distributed=layout, optimizer=SGD, train=train)
    log = _run(gpu, 2, env=STRICT_FP32)
    cpu_log = _run(cpu, 2)
    assert "rank 0/2 (local 0/2) on cuda:0" in log and "rank 0: pipeline stage 0/2" in log, log[-3000:]
    assert KEPT in log, log[-3000:]
    messages = _nccl_messages(log)  # the activations and gradients over NCCL; the tied table's sum through the host
    assert sorted(messages) == [0, 1] and all(sent > 0 and got > 0 for _, sent, got in messages.values()), log[-3000:]
    norms = [[float(x) for x in re.findall(r"grad_norm ([0-9.e+-]+)", text)] for text in (log, cpu_log)]
    assert norms[0] and len(norms[0]) == len(norms[1])  # the table counted once, after its sum, on both
    np.testing.assert_allclose(norms[0], norms[1], rtol=1e-5)
    gpu_params, cpu_params = stage_parameters(gpu), stage_parameters(cpu)
    (tied,) = [n for n in cpu_params if n.endswith("wte.weight")]
    _compare(gpu_params, cpu_params, initial_parameters(cpu), "GPT-2 pp 2")
    copies = []  # each stage's copy of the tied table: the same bits (the same sum, added in stage order)
    for file in params_files(list_complete(gpu.checkpoints_dir)[-1].path):
        with h5py.File(file, "r") as f:
            copies += [ds[()].tobytes() for ds in f["parameters"].values() if str(ds.attrs["name"]) == tied]
    assert len(copies) == 2 and copies[0] == copies[1]


def test_cnn_export_with_batchnorm_in_two_stages_on_two_gpus_equals_two_cpu_ranks(tmp_path):
    """The torch CNN export cut into two stages, a BatchNorm on each side: stage 0's forward passes normalise by the
    micro-batch (the batch form of its eval model, graph/pipeline_parallel/batchnorm_forward.py; recomputed in the
    backward call, not kept) on the GPU as on CPU ranks, and both stages' running statistics are kept, saved and
    averaged over nothing. Weights and running statistics against the same layout on CPU ranks (SGD, strict fp32:
    cuDNN's convolutions and batch statistics round differently from the CPU's by float32 rounding only)."""
    from ortflow.checkpoints import list_complete
    from ortflow.checkpoints.h5state import read_params
    from tests.gpu.test_gpu_cuda_kernels import conv_libraries_missing
    from tests.gpu.test_gpu_four_layouts import ATOL, SGD, STRICT_FP32
    from tests.trainer.test_batchnorm_mpi import cnn_run

    if why := conv_libraries_missing():
        pytest.skip(why)

    layout = {"pipeline_parallel_size": 2}
    gpu = cnn_run(tmp_path, "gpu", 2, distributed={**layout, **GPU}, optimizer=SGD)
    cpu = cnn_run(tmp_path, "cpu", 2, distributed=layout, optimizer=SGD)
    log = _run(gpu, 2, env=STRICT_FP32)
    _run(cpu, 2)
    assert "rank 0/2 (local 0/2) on cuda:0" in log and "rank 0: pipeline stage 0/2" in log, log[-3000:]
    assert RECOMPUTED in log, log[-3000:]  # its forward switches BatchNorm to batch statistics
    assert sorted(_nccl_messages(log)) == [0, 1], log[-3000:]  # the eval model's forward outputs on the GPU too
    checkpoints = [list_complete(cfg.checkpoints_dir) for cfg in (gpu, cpu)]
    assert [c.step for c in checkpoints[0]] == [c.step for c in checkpoints[1]] and checkpoints[0]
    worst, moved = 0.0, 0.0
    first = read_params(checkpoints[1][0].path)
    for g, c in zip(*checkpoints, strict=True):
        gp, cp = read_params(g.path), read_params(c.path)
        assert sorted(gp) == sorted(cp) and sum("running_var" in n for n in cp) == 2
        worst = max(worst, max(float(np.abs(gp[n] - cp[n]).max()) for n in cp))
        moved = max(moved, max(float(np.abs(cp[n] - first[n]).max()) for n in cp))
    print(f"CNN pp 2: max |GPU - CPU| over weights and running statistics {worst:.3g}; moved {moved:.3g}")
    assert worst < 10 * ATOL  # BatchNorm divides by the batch's deviation: a few ulps more than a matmul
    assert moved > 1e3 * ATOL
    evals = [c.meta.get("eval_loss") for c in checkpoints[0]], [c.meta.get("eval_loss") for c in checkpoints[1]]
    assert any(e is not None for e in evals[1])
    np.testing.assert_allclose([e or 0 for e in evals[0]], [e or 0 for e in evals[1]], rtol=1e-5)
