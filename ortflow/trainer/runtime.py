"""Rank start-up, in the order of the C++ TrainingRunner's ``Initialize()``.

1. MPI: world rank/size and local rank/size (the communicator for CPU ranks).
2. Device and execution provider for the local rank (``cuda:<local rank>`` among the visible GPUs).
3. Communicator for gradients: the MPI group, joined to NCCL on the rank's GPU when ``use_nccl`` is set.
4. Model and session configuration: threads, the artifacts, the checkpoint to start from.
5. Session: the engine's ``Module`` (forward and backward only), created from the artifacts' initial state.
6. Checkpoint load: the chosen checkpoint's parameters (HDF5, or a format 1 engine file) are copied by name into the
   session's parameter buffers, then ortflow's update (:mod:`ortflow.trainer.optim`) is built over them, sharded under
   ZeRO-1, and its optimizer state loaded (resharded from any rank count).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ortflow import cuda_libs
from ortflow.config import RunConfig, load_run_config, rank_config
from ortflow.protocol import HEARTBEAT_DIR, NUM_RANKS_ENV
from ortflow.trainer.comm import Communicator, attach_nccl, create_communicator
from ortflow.trainer.optim.rank_update import FOLD_ENV, build_update
from ortflow.trainer.parallel.build import init_layout
from ortflow.trainer.parallel.layout_model import LayoutModel
from ortflow.trainer.parallel.parallel_dims import ParallelDims
from ortflow.trainer.rank_model import RankModel
from ortflow.trainer.startup import (
    THREADS_ENV,
    available_cores,
    load_parameters,
    select_device,
    session_options,
    spin_wait,
    threads_per_rank,
)

log = logging.getLogger("ortflow.trainer")

#: The start-up helpers are re-exported: benches and tests open sessions the way ranks do.
__all__ = ["FOLD_ENV", "HEARTBEAT_DIR", "THREADS_ENV", "LayoutModel", "available_cores", "build_update", "init_runtime",
           "load_parameters", "select_device", "session_options", "spin_wait", "start_mpi", "threads_per_rank"]


def start_mpi(run_dir: Path) -> tuple[RunConfig, Communicator]:
    """Step 1: the resolved config and the process group (MPI under a launcher, else a group of one)."""
    cfg = load_run_config(run_dir)  # every rank validates the resolved config again
    comm = create_communicator(run_dir / HEARTBEAT_DIR, cfg.distributed.collective_timeout_s, cfg.distributed.use_nccl)
    comm.bucket_values = int(cfg.distributed.exchange_bucket_mb * 2**20) // 4  # the host exchange's buckets
    return cfg, comm



def init_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator) -> RankModel:
    """Steps 2-6 on a rank whose process group is up: device, communicator, then the rank model its place in
    ``dp x pp x tp`` asks for (session configuration, sessions, state)."""
    run_dir = Path(run_dir)
    expected = os.environ.get(NUM_RANKS_ENV) or str(cfg.distributed.num_ranks)  # `ortflow train --np` wins
    if expected != "auto" and comm.size != int(expected):
        raise RuntimeError(
            f"started with {comm.size} rank(s) but distributed.num_ranks is {expected}: launch with "
            f"`ortflow train {run_dir} --np {expected}` or change the config (if the launcher did start {expected} "
            "processes, each is a world of one: mpi4py's MPI is not the launcher's, see `ortflow doctor --mpiexec "
            "LAUNCHER`)"
        )
    # A global batch: per-rank batch x accumulation over the data-parallel replicas (the ranks of one pipeline or
    # tensor-parallel group read the same batches).
    dims = ParallelDims.from_world(comm.size, cfg.distributed.pipeline_parallel_size,
                                   cfg.distributed.horizontal_parallel_size)
    cfg = rank_config(cfg, dims.dp, run_dir)
    # 2. Device and execution provider for the local rank.
    device = select_device(cfg, comm.local_rank, comm.local_size)
    # 3. NCCL joins on the rank's GPU (CPU ranks with use_nccl still need one: they stage gradients through it).
    if cfg.distributed.use_nccl:
        if device == "cpu":
            cuda_libs.preload((cuda_libs.NCCL_LIBRARY,), ())
        comm = attach_nccl(comm, cuda_libs.gpu_for_local_rank(comm.local_rank, comm.local_size),
                           cfg.gradient_allreduce_dtype(dims.dp), cfg.distributed.nccl_bucket_mb)
    # 4-6. The rank model its place asks for: a replica of its body (the whole model or its tensor-parallel pieces),
    # with a pipeline schedule when the model is cut into stages (trainer/parallel/layout_model.py).
    return init_layout(run_dir, cfg, comm, device, dims)
