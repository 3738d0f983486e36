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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime

from ortflow import checkpoints
from ortflow.checkpoints import h5state
from ortflow.checkpoints.layout_check import check_checkpoint_layout
from ortflow.config import RunConfig, load_run_config, rank_config
from ortflow.engine import api
from ortflow.trainer import arena, cuda_libs, loss_scale, optim
from ortflow.trainer.comm import Communicator, DeviceBuffer, attach_nccl, create_communicator
from ortflow.trainer.comm.watchdog import HEARTBEAT_DIR
from ortflow.trainer.optim.adasum import AdasumExchange, adasum_mode
from ortflow.trainer.optim.zero import Zero0, Zero1

log = logging.getLogger("ortflow.trainer")

__all__ = ["HEARTBEAT_DIR", "Runtime", "init_runtime", "start_mpi"]


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
    update: optim.Update
    exchange: object  # Zero0, Zero1, AdasumExchange (host) or optim.device.Zero1Device
    trainable: list[str]
    resume: checkpoints.CheckpointInfo | None
    loss_scale: loss_scale.LossScaler = field(default_factory=loss_scale.LossScaler)
    #: Small named arrays/scalars saved with every checkpoint (e.g. a loss scaler's state); read them back on resume
    #: with ``h5state.read_extra_state(rt.resume.path)``.
    extra_state: Callable[[], dict] | None = None
    _grads: list | None = None

    def train_state(self) -> h5state.TrainState:
        """What this rank writes into a checkpoint (parameters on rank 0, optimizer state as sharded)."""
        return h5state.TrainState(
            parameters=lambda: {n: np.array(p.data) for n, p in self.state.parameters},
            trainable=self.trainable, update=self.update, optimizer=optimizer_label(self.cfg),
            rank=self.comm.rank, world_size=self.comm.size, sharded=self.exchange.stage == 1,
            extra_state=self.extra_state,
            replica=writes_per_rank(self.exchange) and self.exchange.stage == 0,
        )

    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) of the training data this rank reads."""
        return self.comm.rank, self.comm.size

    def gradient_buffers(self) -> list:
        """The engine's gradient buffers in ``trainable`` order: host views on the CPU, device buffers on CUDA.

        On CUDA ``Parameter.grad`` returns a host copy, so the device addresses are read from the gradients' OrtValues
        instead; the engine allocates them once with the module, so they stay valid for its whole life.
        """
        if self._grads is None:  # the first call's buffers: a profiling module (trainer.profiling) swaps the state's
            self._grads = self._read_gradient_buffers()
        return self._grads

    def _read_gradient_buffers(self) -> list:
        if self.device == "cpu":
            return [self.state.parameters[n].grad for n in self.trainable]
        buffers = []
        for name in self.trainable:
            grad = self.state._state.get_parameter(name).grad  # the engine's C OrtValue (no copy)
            if grad.data_type() != "tensor(float)":
                raise TypeError(f"gradient of {name} is {grad.data_type()}: only float32 gradients are supported")
            buffers.append(DeviceBuffer(grad.data_ptr(), int(np.prod(grad.shape(), dtype=np.int64)), name))
        return buffers


def choose_start(
    cfg: RunConfig, comm: Communicator, num_stages: int
) -> tuple[checkpoints.CheckpointInfo | None, str | None]:
    """Where every rank starts: the checkpoint to resume (verified by rank 0), else a warm-start folder, else neither.

    Args:
        cfg: The run config (checkpoint dir, checkpoint_to_load_path, init_from).
        comm: The world group; rank 0 chooses and broadcasts.
        num_stages: Pipeline stages of this run; a checkpoint written with another count is refused.
    """
    chosen = warm = None
    if comm.rank == 0:
        found = checkpoints.resolve_resume(cfg.checkpoints_dir, cfg.checkpoint.checkpoint_to_load_path)
        chosen = (str(found.path), found.meta) if found else None
        if found is None and cfg.checkpoint.init_from is not None:  # warm start: its weights, from step 0
            warm = str(checkpoints.verify(cfg.checkpoint.init_from).path)
    # Sync point: all ranks must start from the same checkpoint even if a newer one appears meanwhile.
    chosen, warm = comm.broadcast((chosen, warm), "choose checkpoint")
    resume = checkpoints.CheckpointInfo(Path(chosen[0]), chosen[1]["step"], chosen[1]) if chosen else None
    if resume:
        check_checkpoint_layout(resume.meta, resume.path, num_stages)
    return resume, warm


def writes_per_rank(exchange) -> bool:
    """Whether every rank writes its own optimizer file: ZeRO-1 shards, or Adasum's per-rank (replica) states."""
    return exchange.stage == 1 or getattr(exchange, "per_rank_state", False)


def optimizer_label(cfg: RunConfig) -> str:
    """The rule as recorded in optimizer files: ``adamw/torch``, ``adamw/engine``, ``sgd``, ``lamb``."""
    return f"adamw/{cfg.optimizer.rule}" if cfg.optimizer.name == "adamw" else cfg.optimizer.name


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
    from ortflow.trainer.optim.device import AdasumDevice, DeviceUpdate, Zero1Device

    params = []
    for name in trainable:
        value = state._state.get_parameter(name).data  # the engine's C OrtValue on the device (no copy)
        params.append(DeviceBuffer(value.data_ptr(), int(np.prod(value.shape(), dtype=np.int64)), name))
    rule = optim.build_rule(cfg.optimizer)
    if cfg.distributed.zero_stage == 1 and comm.size > 1:
        exchange = Zero1Device(comm, trainable, params, comm.rank, comm.size)
        decay = optim.decays([s.name for s in exchange.segments], cfg.optimizer.no_weight_decay)
        update = DeviceUpdate(rule, exchange.segments, exchange.param_ptrs(), decay, comm.stream,
                              exchange.sum_across_ranks, len(trainable))
        return update, exchange
    segments = optim.whole_segments(trainable, [p.count for p in params])
    decay = optim.decays(trainable, cfg.optimizer.no_weight_decay)
    update = DeviceUpdate(rule, segments, [p.ptr for p in params], decay, comm.stream)
    if cfg.distributed.enable_adasum and comm.size > 1:
        return update, AdasumDevice(comm, params, adasum_mode(cfg.optimizer.name))
    return update, Zero0(comm)


def available_cores() -> int:
    """Cores this process may run on (affinity-aware)."""
    return len(os.sched_getaffinity(0))


#: ``0``: the host exchange scales the gradients and clips them with passes of their own (the code before the fold);
#: a diagnostic switch for tests and benches, the results are bitwise the same.
FOLD_ENV = "ORTFLOW_FOLD_SCALES"

#: Threads per rank chosen by the launcher (``--threads``, or the auto layout), read by every rank.
THREADS_ENV = "ORTFLOW_THREADS_PER_RANK"


def threads_per_rank(cfg: RunConfig, local_size: int, cores: int, environ: dict | None = None) -> int:
    """distributed.threads_per_rank, else the launcher's choice, else the cores shared evenly by the local ranks."""
    chosen = (os.environ if environ is None else environ).get(THREADS_ENV, "")
    if cfg.distributed.threads_per_rank:
        return cfg.distributed.threads_per_rank
    return int(chosen) if chosen.isdigit() and int(chosen) > 0 else max(1, cores // max(1, local_size))


def session_options(threads: int, deterministic: bool = True, spin: bool = True) -> onnxruntime.SessionOptions:
    """One intra-op pool of ``threads`` per rank, so ranks x threads = cores and ranks do not oversubscribe.

    ``deterministic`` (distributed.deterministic_compute) asks for the engine's repeatable kernels: without it the
    CUDA provider's training differs run to run from the third update on, even in fp32 (bench/results/
    determinism-h200.log), so a resumed run could not end bitwise identical to an uninterrupted one. ``spin``
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

    Measured on the 32-CPU device machine, 16 ranks x 2 threads, the bench GPT against PyTorch DDP at the same layout
    (bench/results/layout-device-w4-spin*.md, 3 interleaved rounds each): ortflow / PyTorch 0.99 (0.96 .. 1.01) with
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
    if hasattr(comm, "bucket_values"):  # MPIComm: the exchange's bucket size (float32 values)
        comm.bucket_values = int(cfg.distributed.exchange_bucket_mb * 2**20) // 4
    return cfg, comm


def init_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator) -> Runtime:
    """Steps 2-6 on a rank whose process group is up: device, communicator, session configuration, session, state."""
    run_dir = Path(run_dir)
    expected = os.environ.get("ORTFLOW_NUM_RANKS") or str(cfg.distributed.num_ranks)  # `ortflow train --np` wins
    if expected != "auto" and comm.size != int(expected):
        raise RuntimeError(
            f"started with {comm.size} rank(s) but distributed.num_ranks is {expected}: launch with "
            f"`ortflow train {run_dir} --np {expected}` or change the config"
        )
    # A global batch: per-rank batch x accumulation over the data-parallel replicas (the ranks of one pipeline or
    # tensor-parallel group read the same batches).
    dist = cfg.distributed
    cfg = rank_config(cfg, comm.size // (dist.horizontal_parallel_size * dist.pipeline_parallel_size), run_dir)
    # 2. Device and execution provider for the local rank.
    device = select_device(cfg, comm.local_rank, comm.local_size)
    # 3. NCCL joins on the rank's GPU (CPU ranks with use_nccl still need one: they stage gradients through it).
    if cfg.distributed.use_nccl:
        if device == "cpu":
            cuda_libs.preload((cuda_libs.NCCL_LIBRARY,), ())
        comm = attach_nccl(comm, cuda_libs.gpu_for_local_rank(comm.local_rank, comm.local_size),
                           cfg.distributed.allreduce_dtype)
    if cfg.distributed.horizontal_parallel_size > 1 and cfg.distributed.pipeline_parallel_size > 1:  # pp x hp
        from ortflow.trainer.parallel.pipe_tensor_piece import init_pipe_tensor_runtime

        return init_pipe_tensor_runtime(run_dir, cfg, comm, device)
    if cfg.distributed.horizontal_parallel_size > 1:  # a tensor-parallel rank: its pieces and process groups
        from ortflow.trainer.parallel.tensor_piece import init_tensor_runtime

        return init_tensor_runtime(run_dir, cfg, comm, device)
    if cfg.distributed.pipeline_parallel_size > 1:  # a pipeline stage: its own artifacts and process groups
        from ortflow.trainer.parallel.pipeline_stage import init_stage_runtime

        return init_stage_runtime(run_dir, cfg, comm, device)
    # 4. Session configuration and the state to start from. Rank 0 verifies (checksums) and every rank loads the same.
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    resume, warm = choose_start(cfg, comm, 1)
    state_file = cfg.artifacts_dir / "checkpoint"
    state = api.CheckpointState.load_checkpoint(str(state_file))
    # 5. Session. On the CPU, from an arena whose first chunk holds every gradient: the engine then allocates them
    # back to back, and the exchange reduces them as one buffer (trainer/arena.py).
    spin = spin_wait(cfg, comm.local_size, threads, available_cores())
    options = session_options(threads, cfg.distributed.deterministic_compute, spin)
    if device == "cpu":
        grad_bytes = 4 * sum(p.data.size for _, p in state.parameters if p.requires_grad)  # fp32 gradients
        options = arena.use_gradient_arena(options, grad_bytes)
    module = api.Module(
        str(cfg.artifacts_dir / "training_model.onnx"),
        state,
        str(cfg.artifacts_dir / "eval_model.onnx"),
        device=device,
        session_options=options,
    )
    # 6. The checkpoint's values into the session's buffers, by name; then the update and its state.
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    if not trainable:
        raise RuntimeError(f"{state_file} holds no trainable parameters: re-run `ortflow configure`")
    if resume or warm:  # a warm start takes the earlier version's weights only (its optimizer state starts fresh)
        load_parameters(state, resume.path if resume else Path(warm), on_device=device != "cpu")
    if device == "cpu":
        update, exchange = build_update(cfg, comm, state, trainable, threads)
    else:
        update, exchange = build_device_update(cfg, comm, state, trainable)
    if resume:
        h5state.load_optimizer(resume.path, update, optimizer_label(cfg), rank=comm.rank)
    where = f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}" if warm else \
        "the initial weights"
    log.info(
        "rank %d/%d (local %d/%d) on %s with %d thread(s), starting from %s",
        comm.rank, comm.size, comm.local_rank, comm.local_size, device, threads, where,
    )
    scaler = loss_scale.from_config(cfg.precision, loss_scale.saved_state(resume.meta) if resume else None)
    if scaler.enabled:
        log.info("rank %d loss scale %g (%s; %d clean updates, %d skipped so far)", comm.rank, scaler.scale,
                 "dynamic" if scaler.dynamic else "static", scaler.clean_updates, scaler.skipped_updates)
    return Runtime(cfg, run_dir, comm, device, threads, state, module, update, exchange, trainable, resume, scaler)


def load_parameters(state, folder: Path, on_device: bool = False, names: set[str] | None = None) -> None:
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
        if on_device:
            param.data = np.ascontiguousarray(values[name])  # copied into the engine's device buffer
        else:
            view[...] = values[name]  # the CPU engine's buffers are writable views
