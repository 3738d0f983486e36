"""ortflow's update and its exchange over a rank's engine buffers, on the host or on the GPU.

A rank model asks for its update once at start: :func:`replica_update` for a data-parallel replica (ZeRO-0, ZeRO-1 or
Adasum, as configured), :func:`whole_update` for a pipeline stage or a tensor-parallel rank (whole tensors; their
replicas average with :class:`~ortflow.trainer.optim.zero.Zero0`). Where the buffers live
(:mod:`ortflow.trainer.comm.engine_buffers`) picks the host rules or the fused CuPy kernels.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ortflow.config import RunConfig
from ortflow.trainer import optim
from ortflow.trainer.comm import Communicator, DeviceBuffer
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.optim.adasum_update import AdasumExchange, adasum_mode
from ortflow.trainer.optim.exchange import Exchange
from ortflow.trainer.optim.zero import Zero0, Zero1

log = logging.getLogger("ortflow.trainer")

#: ``0``: the host exchange scales the gradients and clips them with passes of their own (the code before the fold);
#: a diagnostic switch for tests and benches, the results are bitwise the same.
FOLD_ENV = "ORTFLOW_FOLD_SCALES"


def replica_update(cfg: RunConfig, comm: Communicator, state, trainable: list[str], threads: int,
                   buffers: HostBuffers | DeviceBuffers) -> tuple[optim.Update, Exchange]:
    """A data-parallel replica's update and exchange over its engine's buffers."""
    if buffers.on_device:
        return build_device_update(cfg, comm, state, trainable)
    return build_update(cfg, comm, state, trainable, threads)


def whole_update(cfg: RunConfig, comm: Communicator, names: list[str], params: list,
                 buffers: HostBuffers | DeviceBuffers, threads: int) -> optim.Update:
    """The update of whole tensors ``params`` (``buffers.parameters``), on the replicas' group ``comm``'s stream on
    a GPU."""
    if buffers.on_device:
        from ortflow.trainer.optim.device import device_update

        segments = optim.whole_segments(names, [p.count for p in params])
        return device_update(cfg.optimizer, segments, [p.ptr for p in params], comm.stream)
    return optim.build_update(cfg.optimizer, optim.whole_segments(names, [p.size for p in params]), params,
                              threads=threads)


def build_update(
    cfg: RunConfig, comm: Communicator, state, trainable: list[str], threads: int = 1
) -> tuple[optim.Update, Zero0 | Zero1 | AdasumExchange]:
    """ortflow's update over the engine's parameter buffers (host views), with its exchange and ``threads``."""
    params = [state.parameters[n].data.reshape(-1) for n in trainable]  # writable zero-copy views (CPU engine)
    # The mean's scale and the clip factor applied by the norm and the update as they read the gradients, not by
    # passes of their own (comm/pending.py; the same bits). FOLD_ENV=0: the eager passes (tests and benches compare).
    fold = os.environ.get(FOLD_ENV, "1") != "0"
    if fold and not (cfg.distributed.enable_adasum and comm.size > 1):
        log.info("rank %d: gradient scales folded into the norm and the update (%s=0: eager passes)", comm.rank,
                 FOLD_ENV)
    if cfg.distributed.zero_stage == 1 and comm.size > 1:
        exchange = Zero1(comm, trainable, params, comm.rank, comm.size, fold=fold)
        segments = exchange.segments
        update = optim.build_update(
            cfg.optimizer, segments, exchange.my_params(), exchange.sum_across_ranks, len(trainable), threads
        )
    else:
        if cfg.distributed.enable_adasum and comm.size > 1:
            exchange = AdasumExchange(comm, params, adasum_mode(cfg.optimizer.name))
        else:
            exchange = Zero0(comm, fold=fold)
        segments = optim.whole_segments(trainable, [p.size for p in params])
        update = optim.build_update(cfg.optimizer, segments, params, threads=threads)
    return update, exchange


def build_device_update(cfg: RunConfig, comm, state, trainable: list[str]):
    """The update on the engine's CUDA buffers: fused CuPy kernels on the NCCL stream (ZeRO-1, Adasum over NCCL)."""
    from ortflow.trainer.optim.device import AdasumDevice, Zero1Device, device_update

    params = []
    for name in trainable:
        value = state._state.get_parameter(name).data  # the engine's C OrtValue on the device (no copy)
        params.append(DeviceBuffer(value.data_ptr(), int(np.prod(value.shape(), dtype=np.int64)), name))
    if cfg.distributed.zero_stage == 1 and comm.size > 1:
        dtype = getattr(comm, "allreduce_dtype", "float32")
        exchange = Zero1Device(comm, trainable, params, comm.rank, comm.size, dtype)
        segments, ptrs, sums = exchange.segments, exchange.param_ptrs(), exchange.sum_across_ranks
    else:
        adasum = cfg.distributed.enable_adasum and comm.size > 1
        exchange = AdasumDevice(comm, params, adasum_mode(cfg.optimizer.name)) if adasum else Zero0(comm)
        segments, ptrs, sums = optim.whole_segments(trainable, [p.count for p in params]), [p.ptr for p in params], None
    return device_update(cfg.optimizer, segments, ptrs, comm.stream, sums, len(trainable)), exchange
