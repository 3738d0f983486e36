"""ortflow's update and its exchange over a rank's engine buffers, on the host or on the GPU.

Every layout asks for its update once at start, the same way: :func:`data_parallel_update` over the parameters this
rank holds (the whole model, a pipeline stage, tensor-parallel slices) and the replicas of that part (ZeRO-0, ZeRO-1
or Adasum, as configured). Where the buffers live (:mod:`ortflow.trainer.comm.engine_buffers`) picks the host rules
or the fused CuPy kernels.
"""

from __future__ import annotations

import logging
import os

from ortflow.config import RunConfig
from ortflow.trainer import optim
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.optim.adasum_update import AdasumExchange, adasum_mode
from ortflow.trainer.optim.exchange import Exchange
from ortflow.trainer.optim.zero import Zero0, Zero1

log = logging.getLogger("ortflow.trainer")

#: ``0``: the host exchange scales the gradients and clips them with passes of their own (the code before the fold);
#: a diagnostic switch for tests and benches, the results are bitwise the same.
FOLD_ENV = "ORTFLOW_FOLD_SCALES"


def data_parallel_update(cfg: RunConfig, comm: Communicator, names: list[str], params: list,
                         buffers: HostBuffers | DeviceBuffers, threads: int, fold: bool = True,
                         peers=None) -> tuple[optim.Update, Exchange]:
    """The update of this rank's parameters ``params`` (``buffers.parameters``, in ``names`` order) and the exchange
    over their replicas ``comm``: ZeRO-0, ZeRO-1 or Adasum as configured, whatever part of the model they are.

    Args:
        fold: The host exchange may leave the mean's scale and the clip factor to the norm and the update (nothing
            writes the gradients between the exchange and the update).
        peers: Adasum's tree over tensor-parallel slices (:class:`~.adasum_update.SlicedPeers`), else None.
    """
    if buffers.on_device:
        return build_device_update(cfg, comm, names, params)
    fold = fold and os.environ.get(FOLD_ENV, "1") != "0"
    return host_update(cfg, comm, names, params, threads, fold, peers)


def build_update(
    cfg: RunConfig, comm: Communicator, state, trainable: list[str], threads: int = 1
) -> tuple[optim.Update, Zero0 | Zero1 | AdasumExchange]:
    """ortflow's update over the engine's parameter buffers (host views), with its exchange and ``threads``."""
    params = [state.parameters[n].data.reshape(-1) for n in trainable]  # writable zero-copy views (CPU engine)
    return host_update(cfg, comm, trainable, params, threads, os.environ.get(FOLD_ENV, "1") != "0")


def host_update(cfg: RunConfig, comm: Communicator, trainable: list[str], params: list, threads: int, fold: bool,
                peers=None) -> tuple[optim.Update, Zero0 | Zero1 | AdasumExchange]:
    """The host update over 1-D parameter views and its exchange over ``comm``."""
    # The mean's scale and the clip factor applied by the norm and the update as they read the gradients, not by
    # passes of their own (comm/pending.py; the same bits). FOLD_ENV=0: the eager passes (tests and benches compare).
    if fold and not (cfg.distributed.enable_adasum and comm.size > 1):
        log.info("rank %d: gradient scales folded into the norm and the update (%s=0: eager passes)", comm.rank,
                 FOLD_ENV)
    if cfg.distributed.zero_stage == 1 and comm.size > 1:
        exchange = Zero1(comm, trainable, params, comm.rank, comm.size, fold=fold)
        segments = exchange.segments
        update = optim.build_update(
            cfg.optimizer, segments, exchange.my_params(), exchange.sum_across_ranks, len(trainable), threads,
            cfg.train.num_weight_updates,
        )
    else:
        if cfg.distributed.enable_adasum and comm.size > 1:
            exchange = AdasumExchange(comm, params, adasum_mode(cfg.optimizer.name), peers)
        else:
            exchange = Zero0(comm, fold=fold)
        segments = optim.whole_segments(trainable, [p.size for p in params])
        update = optim.build_update(cfg.optimizer, segments, params, threads=threads,
                                    num_updates=cfg.train.num_weight_updates)
    return update, exchange


def build_device_update(cfg: RunConfig, comm, trainable: list[str], params: list):
    """The update on the engine's CUDA buffers (``DeviceBuffers.parameters``): fused CuPy kernels on the NCCL stream
    (ZeRO-1, Adasum over NCCL)."""
    from ortflow.trainer.optim.device import AdasumDevice, Zero1Device, device_update

    if cfg.distributed.zero_stage == 1 and comm.size > 1:
        dtype = getattr(comm, "allreduce_dtype", "float32")
        exchange = Zero1Device(comm, trainable, params, comm.rank, comm.size, dtype)
        segments, ptrs, sums = exchange.segments, exchange.param_ptrs(), exchange.sum_across_ranks
    else:
        adasum = cfg.distributed.enable_adasum and comm.size > 1
        exchange = AdasumDevice(comm, params, adasum_mode(cfg.optimizer.name)) if adasum else Zero0(comm)
        segments, ptrs, sums = optim.whole_segments(trainable, [p.count for p in params]), [p.ptr for p in params], None
    return device_update(cfg.optimizer, segments, ptrs, comm.stream, sums, len(trainable)), exchange
