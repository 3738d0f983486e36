"""GPU ranks and the NCCL communicator, for real: needs 2 CUDA GPUs, the GPU engine and CuPy (skipped otherwise).

Tolerance for 2 NCCL ranks vs 1 rank on the concatenated batch: the CUDA provider runs matmuls in TF32 by default
(10-bit mantissa, relative error ~5e-4 per product) and cuBLAS picks kernels by batch shape, so the two runs' gradients
differ at ~1e-3 relative, not at fp32 rounding; AdamW turns that into parameter differences far below one learning
rate step (0.01 here). Hence atol 1e-3 (a tenth of a step) and rtol 1e-3; the ranks themselves must stay bitwise equal.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow import cuda_libs
from tests.support.world import check_world


def _ready(gpus: int = 2) -> str | None:
    """Why the tests cannot run here (``None`` when they can): the GPU engine, CuPy and ``gpus`` CUDA GPUs."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "the GPU engine (onnxruntime-training) is not installed"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    count, why = cuda_libs.gpu_count()
    if count >= gpus:
        return None
    return f"needs {gpus} GPU{'s' if gpus > 1 else ''} ({why or f'{count} found'})"


REASON = _ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def _run(cfg, ranks: int, env: dict[str, str] | None = None) -> str:
    """Train ``cfg`` on ``ranks`` ranks under mpiexec (``env``: more environment variables); the tagged output."""
    from ortflow.launch.local import launcher_flavor
    from tests.support.runs import MPIEXEC

    mpiexec = MPIEXEC if Path(MPIEXEC).exists() else shutil.which("mpiexec")
    tag = "--tag-output" if launcher_flavor(Path(mpiexec)) == "openmpi" else "-prepend-rank"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run([mpiexec, "-n", str(ranks), tag, sys.executable, "-u", "-m", "ortflow.trainer",
                          str(cfg.output_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=180, env=env, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]
    check_world(out.stdout, ranks)
    return out.stdout


def _digests(output: str) -> dict[tuple[int, int], str]:
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", output)
    return {(int(rank), int(step)): digest for rank, digest, step in found}


def test_two_nccl_ranks_match_one_cuda_rank_and_stay_identical(tmp_path):
    from tests.support.runs import final_parameters, make_run

    two = make_run(tmp_path, "two", distributed={"num_ranks": 2, "device": "cuda", "use_nccl": True},
                   train={"batch_size": 4})
    one = make_run(tmp_path, "one", distributed={"num_ranks": 1, "device": "cuda", "use_nccl": True},
                   train={"batch_size": 8})
    log = _run(two, 2)
    _run(one, 1)
    assert "on cuda:0" in log and "on cuda:1" in log
    p2, p1 = final_parameters(two), final_parameters(one)
    for name in p1:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-3, atol=1e-3, err_msg=name)
    seen = _digests(log)
    assert {step for _, step in seen} == {5, 10, 15, 20}
    assert all(seen[(0, step)] == seen[(1, step)] for _, step in seen)


def test_cpu_ranks_with_nccl_stage_through_the_gpu(tmp_path):
    from tests.support.runs import final_parameters, make_run

    two = make_run(tmp_path, "staged", distributed={"num_ranks": 2, "use_nccl": True}, train={"batch_size": 4})
    one = make_run(tmp_path, "cpu", distributed={"num_ranks": 1}, train={"batch_size": 8})
    _run(two, 2)
    _run(one, 1)
    p2, p1 = final_parameters(two), final_parameters(one)
    for name in p1:  # CPU arithmetic on both sides: only the summation order differs
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_gradient_buffers_are_the_engines_device_memory_and_are_averaged_in_place(tmp_path):
    from ortflow.trainer.comm import NCCLComm, SingleProcessComm
    from ortflow.trainer.runtime import init_runtime
    from tests.support.runs import make_run

    cfg = make_run(tmp_path, "gpu1", distributed={"num_ranks": 1, "device": "cuda", "use_nccl": True})
    rt = init_runtime(cfg.output_dir, cfg, SingleProcessComm())
    assert isinstance(rt.comm, NCCLComm) and rt.device == "cuda:0"
    names = rt.module.input_names()
    rng = np.random.default_rng(0)
    feeds = {n: np.array([0, 1, 2, 1]) if n == "labels" else rng.normal(size=(4, 8)).astype(np.float32) for n in names}
    rt.module(*(feeds[n] for n in names))
    buffers = rt.gradient_buffers()
    before = [rt.state.parameters[n].grad.copy() for n in rt.trainable]  # host copies on CUDA
    scalars = np.array([1.5, 0.0], dtype=np.float32)
    rt.comm.average_gradients(buffers, 4.0, scalars)  # one rank, divisor 4: gradients / 4 in the engine's buffers
    after = [rt.state.parameters[n].grad for n in rt.trainable]
    for b, a in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b / 4, rtol=1e-6)
    assert scalars[0] == 1.5
    expected_norm = float(np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in after)))
    assert rt.comm.gradient_norm(buffers) == pytest.approx(expected_norm, rel=1e-6)
    rt.update.step(rt.exchange.reduce(buffers, 1.0, scalars), 0.01)  # ortflow's device update on the same buffers
    rt.module.lazy_reset_grad()
    rt.module(*(feeds[n] for n in names))
    assert [b.ptr for b in rt.gradient_buffers()] == [b.ptr for b in buffers]  # the addresses stay put


def test_clipping_on_the_gpu_is_deterministic_and_keeps_ranks_identical(tmp_path):
    from tests.support.runs import make_text_run

    settings = dict(distributed={"num_ranks": 2, "device": "cuda", "use_nccl": True},
                    optimizer={"learning_rate": 0.003, "max_grad_norm": 0.1},
                    checkpoint={"period": 1, "max_num_checkpoints": 1}, train={"display_loss_steps": 1})
    logs = [_run(make_text_run(tmp_path, name, **settings), 2) for name in ("clip-a", "clip-b")]
    runs = [_digests(log) for log in logs]
    for seen in runs:
        assert len({step for _, step in seen}) == 20
        assert all(seen[(0, step)] == seen[(1, step)] for _, step in seen)  # clipped alike on both ranks
    assert runs[0][(0, 20)] == runs[1][(0, 20)]  # the device norm is summed in a fixed order: runs repeat exactly
    norms = [float(x) for x in re.findall(r"grad_norm ([0-9.e+-]+)", logs[0])]
    assert norms and max(norms) > 0.1  # the norm is logged before clipping: clipping was active


def test_zero1_on_nccl_keeps_ranks_identical_and_matches_zero0(tmp_path):
    from tests.support.runs import final_parameters, make_text_run

    runs = {}
    for stage in (0, 1):
        cfg = make_text_run(tmp_path, f"z{stage}", distributed={"num_ranks": 2, "device": "cuda", "use_nccl": True,
                                                                "zero_stage": stage},
                            optimizer={"learning_rate": 0.003, "max_grad_norm": 0.5},
                            checkpoint={"period": 1, "max_num_checkpoints": 1}, train={"display_loss_steps": 1})
        seen = _digests(_run(cfg, 2))
        assert all(seen[(0, step)] == seen[(1, step)] for _, step in seen)  # identical after every update
        runs[stage] = final_parameters(cfg)
        if stage == 1:
            assert len(list(next(cfg.checkpoints_dir.glob("step-*")).glob("optimizer-rank*.h5"))) == 2
    for name in runs[0]:  # same gradients; the norm summed from shards: fp32 rounding apart (as on the CPU test)
        np.testing.assert_allclose(runs[1][name], runs[0][name], rtol=1e-4, atol=1e-6, err_msg=name)
