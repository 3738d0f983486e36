"""Rank start-up, in the order of the C++ TrainingRunner's ``Initialize()``.

1. MPI: world rank/size and local rank/size (the communicator for CPU ranks).
2. Device and execution provider for the local rank (``cuda:<local rank>`` among the visible GPUs).
3. Communicator for gradients: the MPI group, joined to NCCL on the rank's GPU when ``use_nccl`` is set.
4. Model and session configuration: threads, the artifacts, the checkpoint to start from.
5. Session: the engine's ``Module`` and ``Optimizer``.
6. Checkpoint load. The engine's Python API binds parameter values when the session is created, so the checkpoint is
   chosen and verified before step 5 and handed to the session; what the reference guards against (values loaded into
   a graph that is not final yet) cannot happen because the values are matched to the final graph by name, and the
   names are checked against the session's parameters here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

from ortflow.config import RunConfig, load_run_config
from ortflow.engine import api
from ortflow.trainer import checkpoints, cuda_libs
from ortflow.trainer.comm import Communicator, DeviceBuffer, attach_nccl, create_communicator
from ortflow.trainer.parallel.layout import check_checkpoint_layout

log = logging.getLogger("ortflow.trainer")

HEARTBEAT_DIR = ".ranks"


@dataclass
class Runtime:
    """Everything a rank holds while training."""

    cfg: RunConfig
    run_dir: Path
    comm: Communicator
    device: str
    threads: int
    state: object
    module: object
    optimizer: object
    trainable: list[str]
    resume: checkpoints.CheckpointInfo | None

    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) of the training data this rank reads."""
        return self.comm.rank, self.comm.size

    def checkpoint_writer(self) -> dict:
        """Keyword arguments for this rank's CheckpointManager (a pipeline rank writes every stage's file)."""
        return {}

    def gradient_buffers(self) -> list:
        """The engine's gradient buffers in ``trainable`` order: host views on the CPU, device buffers on CUDA.

        On CUDA ``Parameter.grad`` returns a host copy, so the device addresses are read from the gradients' OrtValues
        instead; the engine allocates them once with the module, so they stay valid for its whole life.
        """
        if self.device == "cpu":
            return [self.state.parameters[n].grad for n in self.trainable]
        buffers = []
        for name in self.trainable:
            grad = self.state._state.get_parameter(name).grad  # the engine's C OrtValue (no copy)
            if grad.data_type() != "tensor(float)":
                raise TypeError(f"gradient of {name} is {grad.data_type()}: only float32 gradients are supported")
            buffers.append(DeviceBuffer(grad.data_ptr(), int(np.prod(grad.shape(), dtype=np.int64)), name))
        return buffers


def available_cores() -> int:
    """Cores this process may run on (affinity-aware)."""
    return len(os.sched_getaffinity(0))


def threads_per_rank(cfg: RunConfig, local_size: int, cores: int) -> int:
    """distributed.threads_per_rank, or the machine's cores shared evenly by the ranks on it (at least 1)."""
    return cfg.distributed.threads_per_rank or max(1, cores // max(1, local_size))


def session_options(threads: int) -> onnxruntime.SessionOptions:
    """One intra-op pool of ``threads`` per rank, so ranks x threads = cores and ranks do not oversubscribe."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def select_device(cfg: RunConfig, local_rank: int, local_size: int = 1) -> str:
    """The engine device string for this rank: ``cpu``, or ``cuda:<local rank>`` among the visible GPUs.

    For CUDA it first loads the engine's CUDA 11.8 / cuDNN 8 libraries from pip's ``nvidia-*-cu11`` packages (see
    :mod:`ortflow.trainer.cuda_libs`) and fails clearly when the engine, the libraries or the GPUs are missing.
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
    return f"cuda:{index}"


def start_mpi(run_dir: Path) -> tuple[RunConfig, Communicator]:
    """Step 1: the resolved config and the process group (MPI under a launcher, else a group of one)."""
    cfg = load_run_config(run_dir)  # every rank validates the resolved config again
    comm = create_communicator(run_dir / HEARTBEAT_DIR, cfg.distributed.collective_timeout_s, cfg.distributed.use_nccl)
    return cfg, comm


def init_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator) -> Runtime:
    """Steps 2-6 on a rank whose process group is up: device, communicator, session configuration, session, state."""
    run_dir = Path(run_dir)
    if comm.size != cfg.distributed.num_ranks:
        raise RuntimeError(
            f"started with {comm.size} rank(s) but distributed.num_ranks is {cfg.distributed.num_ranks}: launch with "
            f"`ortflow train {run_dir} --np {cfg.distributed.num_ranks}` or change the config"
        )
    # 2. Device and execution provider for the local rank.
    device = select_device(cfg, comm.local_rank, comm.local_size)
    # 3. NCCL joins on the rank's GPU (CPU ranks with use_nccl still need one: they stage gradients through it).
    if cfg.distributed.use_nccl:
        if device == "cpu":
            cuda_libs.preload((cuda_libs.NCCL_LIBRARY,), ())
        comm = attach_nccl(comm, cuda_libs.gpu_for_local_rank(comm.local_rank, comm.local_size))
    if cfg.distributed.pipeline_parallel_size > 1:  # a pipeline stage: its own artifacts and process groups
        from ortflow.trainer.parallel.stages import init_stage_runtime

        return init_stage_runtime(run_dir, cfg, comm, device)
    # 4. Session configuration and the state to start from. Rank 0 verifies (checksums) and every rank loads the same.
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    chosen = None
    if comm.rank == 0:
        found = checkpoints.resolve_resume(cfg.checkpoints_dir, cfg.checkpoint.checkpoint_to_load_path)
        chosen = (str(found.path), found.meta) if found else None
    # Sync point: all ranks must start from the same checkpoint even if a newer one appears meanwhile.
    chosen = comm.broadcast(chosen, "choose checkpoint")
    resume = checkpoints.CheckpointInfo(Path(chosen[0]), chosen[1]["step"], chosen[1]) if chosen else None
    if resume:
        check_checkpoint_layout(resume.meta, resume.path, 1)
    state_file = resume.path / checkpoints.CHECKPOINT_FILE if resume else cfg.artifacts_dir / "checkpoint"
    state = api.CheckpointState.load_checkpoint(str(state_file))
    # 5. Session.
    module = api.Module(
        str(cfg.artifacts_dir / "training_model.onnx"),
        state,
        str(cfg.artifacts_dir / "eval_model.onnx"),
        device=device,
        session_options=session_options(threads),
    )
    optimizer = api.Optimizer(str(cfg.artifacts_dir / "optimizer_model.onnx"), module)
    # 6. The loaded values must be the session's parameters, in one order on every rank.
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    if not trainable:
        raise RuntimeError(f"{state_file} holds no trainable parameters: re-run `ortflow configure`")
    where = f"step {resume.step} ({resume.path.name})" if resume else "the initial weights"
    log.info(
        "rank %d/%d (local %d/%d) on %s with %d thread(s), starting from %s",
        comm.rank, comm.size, comm.local_rank, comm.local_size, device, threads, where,
    )
    return Runtime(cfg, run_dir, comm, device, threads, state, module, optimizer, trainable, resume)
