"""pp 2 x dp 2, hp 2 x dp 2 and pp 2 x hp 2 on 4 GPUs train to the parameters of the same layout on 4 CPU ranks
(skipped without 4 GPUs, the GPU engine and CuPy).

Each layout trains twice from the same weights on the same batches under ``mpiexec -n 4``: on GPU ranks (NCCL stage
sends, tensor-parallel sums and replica averages, ortflow's device update) and on CPU ranks (MPI, the host update).
The CPU layouts are held to the unsplit model by tests/trainer (test_pipeline_mpi.py, test_tensor_mpi.py), so equal
parameters here mean the GPU paths compute the same training.

Tolerance. The CUDA provider runs fp32 MatMuls in TF32 by default (a 10-bit mantissa), and the engine's training
``Module`` takes a device name, not provider options, so its ``use_tf32`` cannot be turned off there. NVIDIA's
libraries (cuBLAS, cuDNN) honour ``NVIDIA_TF32_OVERRIDE=0`` over any programmatic setting: the GPU runs set it, so
both sides compute in fp32. What remains is fp32 rounding: GPU and CPU kernels add in other orders and their exp/erf
differ by an ulp or two, so gradients differ by ~1e-6 relative. The runs use plain SGD, which moves a weight by lr x
its gradient: 4 updates at lr 1e-2 of gradients below 1 put the parameters ~4e-8 apart. AdamW would not do:
m / (sqrt(v) + eps) lifts a gradient at rounding level (~1e-7) to a step of ~lr whatever its sign, so a few-ulp change
there moves a weight by up to lr (tests/trainer/test_tensor_mpi.py measures it). The bound is 1e-6, and the runs must
move their weights by more than 100x that: a missing sum, a wrong slice or an unaveraged replica moves weights by
~lr x gradient (1e-4 and more). Were TF32 still on, the difference would be ~lr x 4 x 5e-4 ~ 2e-5 and fail the bound:
the message says so.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow import cuda_libs
from tests.gpu.test_gpu_training import REASON, _digests, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(REASON is not None, reason=str(REASON)),
    pytest.mark.skipif(REASON is None and cuda_libs.gpu_count()[0] < 4,
                       reason=f"needs 4 GPUs ({cuda_libs.gpu_count()[0]} found)"),
]

ATOL = 1e-6
SGD = {"name": "sgd", "learning_rate": 1e-2}
GPU = {"device": "cuda", "use_nccl": True, "collective_timeout_s": 60.0}  # a lost message is named within 60 s
STRICT_FP32 = {"NVIDIA_TF32_OVERRIDE": "0"}


def _compare(gpu: dict[str, np.ndarray], cpu: dict[str, np.ndarray], initial: dict[str, np.ndarray], label: str):
    assert sorted(gpu) == sorted(cpu)
    worst = max(float(np.abs(gpu[n] - cpu[n]).max()) for n in cpu)
    moved = max(float(np.abs(cpu[n] - initial[n]).max()) for n in cpu)
    print(f"{label}: max |GPU - CPU parameter| {worst:.3g}; largest move in training {moved:.3g}")
    assert worst < ATOL, (f"{label}: GPU parameters differ from the CPU ranks' by {worst:.3g} (bound {ATOL}; ~2e-5 "
                          "would mean TF32 stayed on, ~1e-3 a wrong sum or average)")
    assert moved > 100 * ATOL, f"{label}: training moved the weights by {moved:.3g} only: the comparison is void"


def _device(cfg, rank: int) -> str:
    """Where rank ``rank`` of a one-host run trains (its local rank's GPU)."""
    return f"cuda:{rank}" if cfg.distributed.device == "cuda" else "cpu"


def _final_losses(cfg) -> tuple[float, float | None]:
    from ortflow.checkpoints import list_complete

    meta = list_complete(cfg.checkpoints_dir)[-1].meta
    return meta["train_loss"], meta.get("eval_loss")


def _assert_losses_match(gpu, cpu) -> None:
    (train_g, eval_g), (train_c, eval_c) = _final_losses(gpu), _final_losses(cpu)
    assert train_g == pytest.approx(train_c, rel=1e-5)
    assert (eval_g is None) == (eval_c is None)
    if eval_c is not None:
        assert eval_g == pytest.approx(eval_c, rel=1e-5)


def test_pp2_dp2_on_four_gpus_equals_the_same_layout_on_cpu_ranks(tmp_path):
    from tests.support.parallel_runs import initial_parameters
    from tests.support.runs import make_text_run
    from tests.trainer.test_pipeline_mpi import TRAIN, stage_parameters

    layout = {"num_ranks": 4, "pipeline_parallel_size": 2}
    gpu = make_text_run(tmp_path, "gpu", distributed={**layout, **GPU}, train=TRAIN, optimizer=SGD)
    cpu = make_text_run(tmp_path, "cpu", distributed=layout, train=TRAIN, optimizer=SGD)
    log = _run(gpu, 4, env=STRICT_FP32)
    _run(cpu, 4)
    for rank, stage in ((0, 0), (1, 1), (2, 0), (3, 1)):  # rank = replica * 2 + stage, one GPU each
        assert f"rank {rank} on {_device(gpu, rank)}: pipeline stage {stage}/2" in log, log[-3000:]
    _compare(stage_parameters(gpu), stage_parameters(cpu), initial_parameters(cpu), "pp 2 x dp 2")
    _assert_losses_match(gpu, cpu)
    seen = _digests(log)
    last = max(step for _, step in seen)
    assert seen[(0, last)] == seen[(2, last)] and seen[(1, last)] == seen[(3, last)], seen  # replicas: same bits
    assert seen[(0, last)] != seen[(1, last)]


def test_hp2_dp2_on_four_gpus_equals_the_same_layout_on_cpu_ranks(tmp_path):
    from ortflow.checkpoints.h5state import read_params
    from tests.support.parallel_runs import gpt_run, initial_parameters, newest

    layout = {"num_ranks": 4, "horizontal_parallel_size": 2}
    gpu = gpt_run(tmp_path, "gpu", distributed={**layout, **GPU}, optimizer=SGD)
    cpu = gpt_run(tmp_path, "cpu", distributed=layout, optimizer=SGD)
    log = _run(gpu, 4, env=STRICT_FP32)
    _run(cpu, 4)
    assert all(f"rank {r}: tensor-parallel rank {r % 2}/2 of replica {r // 2}/2" in log for r in range(4)), log[-3000:]
    _compare(read_params(newest(gpu)), read_params(newest(cpu)), initial_parameters(cpu), "hp 2 x dp 2")
    _assert_losses_match(gpu, cpu)
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) \(replicated ([0-9a-f]{64})\)", log)
    last = {int(rank): (whole, replicated) for rank, whole, replicated in found}  # the last check of each rank
    assert sorted(last) == [0, 1, 2, 3]
    assert len({replicated for _, replicated in last.values()}) == 1  # replicated parameters: same bits everywhere
    assert last[0][0] == last[2][0] and last[1][0] == last[3][0] and last[0][0] != last[1][0]  # slices per tp rank


def test_pp2_hp2_on_four_gpus_equals_the_same_layout_on_cpu_ranks(tmp_path):
    """Two stages of two tensor-parallel ranks: the stages' pieces keep their activations on the GPU and hand what
    crosses the cut to the pipeline's NCCL sends as host arrays."""
    from ortflow.checkpoints.h5state import read_params
    from tests.support.parallel_runs import gpt_run, initial_parameters, newest

    layout = {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}
    gpu = gpt_run(tmp_path, "gpu", distributed={**layout, **GPU}, optimizer=SGD)
    cpu = gpt_run(tmp_path, "cpu", distributed=layout, optimizer=SGD)
    log = _run(gpu, 4, env=STRICT_FP32)
    _run(cpu, 4)
    for rank in range(4):  # rank = stage * 2 + t (one replica), one GPU each
        assert (f"rank {rank}: tensor-parallel rank {rank % 2}/2 of replica 0/1 of pipeline stage {rank // 2}/2"
                in log), log[-3000:]
    kept = [(int(n), int(k)) for n, k in re.findall(r"(\d+) pieces \((\d+) keep their activations\)", log)]
    assert len(kept) == 4 and all(k > 0 for _, k in kept), kept  # stage 0: every piece; stage 1: all but the loss's
    _compare(read_params(newest(gpu)), read_params(newest(cpu)), initial_parameters(cpu), "pp 2 x hp 2")
    _assert_losses_match(gpu, cpu)


def test_gpt2_export_at_pp2_hp2_on_four_gpus_equals_the_same_layout_on_cpu_ranks(tmp_path):
    """The Hugging Face GPT-2 export in 2 stages of 2 tensor-parallel ranks: its token table is sliced by vocabulary
    in the embedding (stage 0) and the LM head (stage 1), and each tensor-parallel rank's two copies of its slice add
    their gradients through the host over its pipeline group."""
    from ortflow.checkpoints.h5state import read_params
    from tests.support.parallel_runs import initial_parameters, newest
    from tests.trainer.exports_runs import gpt2_run

    layout, train = {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}, {"num_train_steps": 8}
    gpu = gpt2_run(tmp_path, "gpu", distributed={**layout, **GPU}, optimizer=SGD, train=train)
    cpu = gpt2_run(tmp_path, "cpu", distributed=layout, optimizer=SGD, train=train)
    _run(gpu, 4, env=STRICT_FP32)
    _run(cpu, 4)
    gpu_params, cpu_params = read_params(newest(gpu)), read_params(newest(cpu))
    assert [n for n in cpu_params if n.endswith("wte.weight")], "the GPT-2 export has no token table"
    _compare(gpu_params, cpu_params, initial_parameters(cpu), "GPT-2 pp 2 x hp 2")
    _assert_losses_match(gpu, cpu)
