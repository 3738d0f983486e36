"""Rank start-up pieces every rank model shares: threads and session options, the device, the checkpoint to start
from, loading parameters by name."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import onnxruntime

from ortflow import checkpoints, cuda_libs
from ortflow.checkpoints import h5state
from ortflow.checkpoints.layout_check import check_checkpoint_layout
from ortflow.config import RunConfig
from ortflow.protocol import THREADS_ENV
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers

log = logging.getLogger("ortflow.trainer")


def choose_start(
    cfg: RunConfig, comm: Communicator, num_stages: int
) -> tuple[checkpoints.CheckpointInfo | None, str | None]:
    """Where every rank starts: the checkpoint to resume (verified by rank 0), else a warm-start folder, else neither.

    Args:
        cfg: The run config (checkpoint dir, checkpoint_to_load_path, init_from).
        comm: The world group; rank 0 chooses and broadcasts.
        num_stages: Pipeline stages of this run; a checkpoint written with another count (or, on a tensor-parallel
            run, another tensor-parallel size) is refused.
    """
    chosen = warm = None
    if comm.rank == 0:
        owner = checkpoints.run_owner(cfg)  # the first training of a folder gives it its id
        found = checkpoints.resolve_resume(cfg.checkpoints_dir, cfg.checkpoint.checkpoint_to_load_path, owner)
        chosen = (str(found.path), found.meta) if found else None
        if found is None and cfg.checkpoint.init_from is not None:  # warm start: its weights, from step 0
            warm = str(checkpoints.verify(cfg.checkpoint.init_from).path)
    # Sync point: all ranks must start from the same checkpoint even if a newer one appears meanwhile.
    chosen, warm = comm.broadcast((chosen, warm), "choose checkpoint")
    resume = checkpoints.CheckpointInfo(Path(chosen[0]), chosen[1]["step"], chosen[1]) if chosen else None
    if resume:
        check_checkpoint_layout(resume.meta, resume.path, num_stages, cfg.distributed.horizontal_parallel_size,
                                named=cfg.checkpoint.checkpoint_to_load_path is not None)
    return resume, warm


def available_cores() -> int:
    """Cores this process may run on (affinity-aware)."""
    return len(os.sched_getaffinity(0))




def threads_per_rank(cfg: RunConfig, local_size: int, cores: int, environ: dict | None = None) -> int:
    """distributed.threads_per_rank, else the launcher's choice, else the config's default for this host
    (:meth:`~ortflow.config.distributed.DistributedConfig.default_threads`)."""
    chosen = (os.environ if environ is None else environ).get(THREADS_ENV, "")
    if cfg.distributed.threads_per_rank:
        return cfg.distributed.threads_per_rank
    return int(chosen) if chosen.isdigit() and int(chosen) > 0 else cfg.distributed.default_threads(cores, local_size)


def session_options(threads: int, deterministic: bool = True, spin: bool = True) -> onnxruntime.SessionOptions:
    """One intra-op pool of ``threads`` per rank, so ranks x threads = cores and ranks do not oversubscribe.

    ``deterministic`` (distributed.deterministic_compute) asks for the engine's repeatable kernels: without it the
    CUDA provider's training differs run to run from the third update on, even in fp32 (measured on
    an H200), so a resumed run could not end bitwise identical to an uninterrupted one. ``spin``
    False makes the pool's threads sleep between parallel sections instead of spinning (:func:`spin_wait`).
    """
    options = onnxruntime.SessionOptions()
    options.use_deterministic_compute = deterministic
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def spin_wait(cfg: RunConfig, local_size: int, threads: int, cores: int) -> bool:
    """distributed.thread_spinning: on, off, or (auto) off when several local ranks fill every core.

    Measured on a 32-CPU Xeon host, 16 ranks x 2 threads, the bench GPT against PyTorch DDP at the same layout
    (3 interleaved rounds each): ortflow / PyTorch 0.99 (0.96 .. 1.01) with
    sleeping threads, 0.93 (0.86 .. 0.94) spinning; the exchange's wait for the slowest rank fell from 13-20% of the
    update to 3-9%. One rank alone keeps the engine's default (spinning shortens its parallel sections' start).
    """
    choice = cfg.distributed.thread_spinning
    if choice != "auto":
        return choice == "on"
    return not (local_size > 1 and local_size * threads >= cores)


def select_device(cfg: RunConfig, local_rank: int, local_size: int = 1) -> str:
    """The engine device string for this rank: ``cpu``, or ``cuda:<local rank>`` among the visible GPUs.

    For CUDA it first loads the engine's CUDA 11.8 / cuDNN 8 libraries from pip's ``nvidia-*-cu11`` packages (see
    :mod:`ortflow.cuda_libs`) and fails clearly when the engine, the libraries or the GPUs are missing.
    """
    if cfg.distributed.device == "cpu":
        return "cpu"
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise RuntimeError(
            f"distributed.device is cuda but the installed engine ({onnxruntime.__version__}) is the CPU build: "
            "install onnxruntime-training==1.19.2 in place of onnxruntime-training-cpu (docs/gpu.md)"
        )
    index = cuda_libs.gpu_for_local_rank(local_rank, local_size)
    report = cuda_libs.preload()
    engine_missing = [name for name in report.missing if name in cuda_libs.ENGINE_LIBRARIES]
    if engine_missing:
        raise RuntimeError(
            f"the GPU engine needs {', '.join(engine_missing)} (CUDA 11.8 / cuDNN 8): install ortflow's `cuda` extra "
            f"or name their folder in {cuda_libs.ENV_DIRS} (docs/gpu.md); `ortflow doctor` lists what is found"
        )
    for what, ops, absent in cuda_libs.missing_for_ops(recorded_op_types(cfg.output_dir), report):
        raise RuntimeError(
            f"the model's {'/'.join(ops)} nodes need cuDNN's {what} library ({', '.join(absent)}), which was not "
            f"found (cuDNN would abort the rank at the first one): install nvidia-cudnn-cu11 (ortflow's `cuda` extra) "
            f"or name its folder in {cuda_libs.ENV_DIRS}; `ortflow doctor` lists what is found"
        )
    return f"cuda:{index}"


def recorded_op_types(run_dir: Path) -> list[str]:
    """The model's op types as configure recorded them (configure.json ``op_types``; none in an older record)."""
    try:
        return list(json.loads((Path(run_dir) / "configure.json").read_text()).get("op_types", []))
    except (OSError, ValueError):
        return []


def load_parameters(state, folder: Path, buffers: HostBuffers | DeviceBuffers, names: set[str] | None = None) -> None:
    """Copy a checkpoint's parameters into the session's buffers by name (shapes and names checked); ``names``
    reads only those (a pipeline stage's)."""
    values = h5state.read_params(folder, names)
    names = {name for name, _ in state.parameters}
    if set(values) != names:
        missing, extra = sorted(names - set(values)), sorted(set(values) - names)
        raise checkpoints.CheckpointError(
            f"{folder.name} does not match the model: missing {missing[:5]}, unknown {extra[:5]}; resume from a "
            "checkpoint of this model or start a new run"
        )
    for name, param in state.parameters:
        view = param.data
        if view.shape != values[name].shape:
            raise checkpoints.CheckpointError(
                f"{folder.name}: {name} has shape {list(values[name].shape)}, the model {list(view.shape)}"
            )
        buffers.write(param, values[name])
