"""One pipeline stage on one rank: its engine session, its weight update, the process-group layout, its checkpoint part.

Layout: ``rank = replica * P + stage`` (a replica's stages are neighbouring ranks, so on one host they talk through
shared memory). Two sub-groups: ``stage_comm`` (the D replicas of this stage: gradient averaging, as unsplit
data-parallel training does) and ``pipe_comm`` (the P stages of this replica: activations and gradients).

The weight update is ortflow's (:mod:`ortflow.trainer.optim`) over the stage's parameter buffers; a checkpoint holds
every stage's ``params``/``optimizer`` HDF5 files, written by each stage's first replica into the one folder
(:func:`ortflow.checkpoints.h5state.write_state`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

from ortflow.build.records import GRAD_IN_SUFFIX, read_stages_record, stage_dir
from ortflow.checkpoints import h5state
from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer import optim
from ortflow.trainer.comm import Communicator
from ortflow.trainer.optim.zero import Zero0
from ortflow.trainer.runtime import (
    Runtime,
    available_cores,
    build_device_update,
    choose_start,
    load_parameters,
    optimizer_label,
    session_options,
    threads_per_rank,
)

log = logging.getLogger("ortflow.trainer")


_SHARED_ARENA: list[bool] = []
#: Point-to-point message tags: activations go forward, gradients come back, tied-weight gradients between holders.
ACT_TAG, GRAD_TAG, TIED_TAG = 1, 2, 3


def stage_session_options(threads: int, device: str, deterministic: bool = True) -> onnxruntime.SessionOptions:
    """The trainer's session options; on the CPU, one arena for the stage's two sessions, grown as requested, and no
    memory patterns.

    A stage runs two sessions every micro-batch (the eval model's forward, the training model's recompute + backward),
    so what one frees the other must be able to reuse. Measured on the bench GPT at 32 sequences per micro-batch
    (``python -m bench.pipeline_memory``, peak RSS growth of stage 0's eval forward + training call; the training call
    alone: 70 MiB): an arena per session (the engine's default) 186 MiB; one shared arena 97 MiB, because each session's
    memory pattern asks for one block of its whole plan and the eval plan's freed block cannot hold the training plan;
    one shared arena without memory patterns, extended by what is requested instead of the next power of two (which
    alone gave 136 MiB for the training call by itself), 72 MiB, the training call's own working set. The
    price: about 4% more CPU per call at 4 sequences (per-tensor allocations), none measurable at 32.
    """
    options = session_options(threads, deterministic)
    if device == "cpu":
        if not _SHARED_ARENA:
            info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                             onnxruntime.OrtMemType.DEFAULT)
            # OrtArenaCfg(max_mem, arena_extend_strategy, initial_chunk_size_bytes, max_dead_bytes_per_chunk):
            # 0 / -1 keep the engine's defaults; strategy 1 = kSameAsRequested.
            onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, 1, -1, -1))
            _SHARED_ARENA.append(True)
        options.add_session_config_entry("session.use_env_allocators", "1")
        options.enable_mem_pattern = False
    return options


@dataclass
class StageRuntime(Runtime):
    """A rank of a pipeline: the unsplit Runtime's fields for its own stage, plus where it sits."""

    stage: int = 0
    num_stages: int = 1
    replica: int = 0
    num_replicas: int = 1
    stage_comm: Communicator | None = None
    pipe_comm: Communicator | None = None
    receives: tuple[str, ...] = ()
    sends: tuple[str, ...] = ()
    shared: dict[str, list[int]] | None = None  # tied parameters it holds -> every holding stage, in order

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def data_shard(self) -> tuple[int, int]:
        """Every stage of a replica reads that replica's batches (the first needs inputs, the last labels)."""
        return self.replica, self.num_replicas

    def train_state(self) -> h5state.TrainState:
        """This stage's files of a checkpoint, written by its first replica (the others write nothing)."""
        return h5state.TrainState(
            parameters=lambda: {n: np.array(p.data) for n, p in self.state.parameters},
            trainable=self.trainable, update=self.update, optimizer=optimizer_label(self.cfg),
            rank=self.replica, world_size=self.num_replicas, stage=(self.stage, self.num_stages),
        )

    # -- the engine calls ------------------------------------------------------------------------------------------

    def _call(self, train: bool, feeds: dict[str, np.ndarray]) -> list:
        module = self.module
        module.train() if train else module.eval()
        outputs = module(*(feeds[n] for n in module.input_names()))
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

    def forward(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """A middle stage's forward pass (eval model, which outputs just the sent tensors; nothing is kept)."""
        return self._call(False, feeds)[: len(self.sends)]

    def backward(self, feeds: dict[str, np.ndarray], grads: list[np.ndarray] | None) -> tuple[float, list]:
        """Recompute the forward pass and run the backward pass (the last stage: from its loss; others: driven by
        ``grads``); parameter gradients accumulate in the engine. Returns (loss, gradients of what it received)."""
        if grads is not None:
            feeds = {**feeds, **{n + GRAD_IN_SUFFIX: g for n, g in zip(self.sends, grads, strict=True)}}
        outputs = self._call(True, feeds)
        return float(outputs[0]), outputs[1 : 1 + len(self.receives)]

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        """The last stage's loss on an eval batch (eval model)."""
        return float(self._call(False, feeds)[0])



def init_stage_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str) -> StageRuntime:
    """Place this rank in the pipeline, load its stage's artifacts and the state to start from."""
    num_stages = cfg.distributed.pipeline_parallel_size
    num_replicas = comm.size // num_stages
    replica, stage = divmod(comm.rank, num_stages)
    record = read_stages_record(cfg.artifacts_dir)
    if record is None or len(record["stages"]) != num_stages:
        raise RuntimeError(
            f"{cfg.artifacts_dir} holds no {num_stages}-stage pipeline artifacts: re-run `ortflow configure` with "
            f"distributed.pipeline_parallel_size {num_stages}"
        )
    tied = sorted({name for info in record["stages"] for name in info.get("shared", {})})
    if tied and device != "cpu":  # every rank reads the same record, so every rank stops here with this message
        raise RuntimeError(f"tied parameters across pipeline stages {tied} are summed on the host: not supported on "
                           "CUDA yet; move model.pipeline_cuts so their readers share a stage, or train on the CPU")
    # Sync points (collective over the world): the two sub-groups every rank joins (NCCL groups under use_nccl).
    stage_comm = comm.split(stage, "pipeline stage group")
    pipe_comm = comm.split(num_stages + replica, "pipeline replica group")
    if hasattr(pipe_comm, "open_point_to_point"):  # NCCL: its p2p communicators, before any transfer is in flight
        pipe_comm.open_point_to_point((ACT_TAG, GRAD_TAG))
    resume, warm = choose_start(cfg, comm, num_stages)
    folder = stage_dir(cfg.artifacts_dir, stage)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device=device,
                        session_options=stage_session_options(threads, device,
                                                                 cfg.distributed.deterministic_compute))
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    if resume or warm:  # this stage's parameters, read by name from the stage files (or a whole model's params.h5)
        load_parameters(state, resume.path if resume else Path(warm), on_device=device != "cpu",
                        names={name for name, _ in state.parameters})
    update = build_stage_update(cfg, stage_comm, state, trainable, threads, device)
    if resume:
        h5state.load_optimizer(resume.path, update, optimizer_label(cfg), rank=replica)
    info = record["stages"][stage]
    where = f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}" if warm else \
        "the initial weights"
    log.info("rank %d on %s: pipeline stage %d/%d of replica %d/%d, %d parameter tensors, receives %s, sends %s, "
             "starting from %s", comm.rank, device, stage, num_stages, replica, num_replicas, len(trainable),
             info["receives"], info["sends"], where)
    rt = StageRuntime(cfg, Path(run_dir), comm, device, threads, state, module, update, Zero0(stage_comm), trainable,
                      resume,
                      stage=stage, num_stages=num_stages, replica=replica, num_replicas=num_replicas,
                      stage_comm=stage_comm, pipe_comm=pipe_comm, receives=tuple(info["receives"]),
                      sends=tuple(info["sends"]), shared=info.get("shared", {}))
    return rt



def build_stage_update(cfg: RunConfig, stage_comm: Communicator, state, trainable: list[str], threads: int,
                       device: str) -> optim.Update:
    """ortflow's update over this stage's parameter buffers: whole tensors (the stage's replicas average, ZeRO-0)."""
    if device != "cpu":  # the engine's CUDA buffers, on the stage group's NCCL stream
        return build_device_update(cfg, stage_comm, state, trainable)[0]
    params = [state.parameters[n].data.reshape(-1) for n in trainable]  # writable zero-copy views (CPU engine)
    return optim.build_update(cfg.optimizer, optim.whole_segments(trainable, [p.size for p in params]), params,
                              threads=threads)
