"""One pipeline stage on one rank: its engine session, the process-group layout, and its checkpoint files.

Layout: ``rank = replica * P + stage`` (a replica's stages are neighbouring ranks, so on one host they talk through
shared memory). Two sub-groups: ``stage_comm`` (the D replicas of this stage: gradient averaging, as unsplit
data-parallel training does) and ``pipe_comm`` (the P stages of this replica: activations and gradients).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer import checkpoints
from ortflow.trainer.comm import Communicator
from ortflow.trainer.parallel.layout import check_checkpoint_layout
from ortflow.trainer.parallel.stage_artifacts import GRAD_IN_SUFFIX, read_stages_record, stage_dir
from ortflow.trainer.runtime import Runtime, available_cores, session_options, threads_per_rank

log = logging.getLogger("ortflow.trainer")


def stage_file(index: int) -> str:
    """File name of stage ``index``'s state in a checkpoint folder (stage 0 keeps the unsplit name)."""
    return checkpoints.CHECKPOINT_FILE if index == 0 else f"{checkpoints.CHECKPOINT_FILE}.stage-{index:02d}"


def write_stage_states(blobs: list[bytes], path: Path) -> None:
    """Checkpoint writer for the writer rank: every stage's state file into the checkpoint's temporary folder.

    The one place that knows the per-stage layout on disk (re-point it when the checkpoint format changes).
    """
    for index, blob in enumerate(blobs):
        (path.parent / stage_file(index)).write_bytes(blob)


def read_stage_state(folder: Path, index: int) -> object:
    """Stage ``index``'s engine state from a checkpoint folder written by :func:`write_stage_states`."""
    file = Path(folder) / stage_file(index)
    if not file.is_file():
        raise checkpoints.CheckpointError(
            f"{folder} has no state for pipeline stage {index} ({file.name}): it was written with another "
            "distributed.pipeline_parallel_size; resume with that size or start a new run"
        )
    return api.CheckpointState.load_checkpoint(str(file))


def state_bytes(state: object) -> bytes:
    """The engine state (parameters and optimizer moments) as the bytes of its checkpoint file."""
    with tempfile.TemporaryDirectory(prefix="ortflow-stage-") as tmp:
        path = Path(tmp) / "state"
        api.CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)
        return path.read_bytes()


_SHARED_ARENA: list[bool] = []


def stage_session_options(threads: int, device: str) -> onnxruntime.SessionOptions:
    """The trainer's session options, plus, on the CPU, one arena shared by the stage's two sessions.

    A stage runs two sessions (the eval model's forward, the training model's recompute + backward). With an arena
    each, both peaks stay resident: measured on the bench GPT at 32 sequences per micro-batch, stage 0 held 185 MB of
    engine memory vs 124 MB unsplit; with one process-wide arena that both sessions use, 96 MB (docs/parallel.md).
    """
    options = session_options(threads)
    if device == "cpu":
        if not _SHARED_ARENA:
            info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                             onnxruntime.OrtMemType.DEFAULT)
            onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, -1, -1, -1))
            _SHARED_ARENA.append(True)
        options.add_session_config_entry("session.use_env_allocators", "1")
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

    def checkpoint_writer(self) -> dict:
        return {"writer": write_stage_states}

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

    def update(self, lr: float) -> None:
        """The weight update of this stage's parameters: the engine's optimizer for now (one call to re-point)."""
        self.optimizer.set_learning_rate(lr)
        self.optimizer.step()
        self.module.lazy_reset_grad()


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
    # Sync points (collective over the world): the two sub-groups every rank joins (NCCL groups under use_nccl).
    stage_comm = comm.split(stage, "pipeline stage group")
    pipe_comm = comm.split(num_stages + replica, "pipeline replica group")
    chosen = None
    if comm.rank == 0:
        found = checkpoints.resolve_resume(cfg.checkpoints_dir, cfg.checkpoint.checkpoint_to_load_path)
        chosen = (str(found.path), found.meta) if found else None
    # Sync point: all ranks must start from the same checkpoint even if a newer one appears meanwhile.
    chosen = comm.broadcast(chosen, "choose checkpoint")
    resume = checkpoints.CheckpointInfo(Path(chosen[0]), chosen[1]["step"], chosen[1]) if chosen else None
    if resume:
        check_checkpoint_layout(resume.meta, resume.path, num_stages)
    folder = stage_dir(cfg.artifacts_dir, stage)
    state = read_stage_state(resume.path, stage) if resume else api.CheckpointState.load_checkpoint(
        str(folder / "checkpoint"))
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device=device,
                        session_options=stage_session_options(threads, device))
    optimizer = api.Optimizer(str(folder / "optimizer_model.onnx"), module)
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    info = record["stages"][stage]
    where = f"step {resume.step} ({resume.path.name})" if resume else "the initial weights"
    log.info("rank %d: pipeline stage %d/%d of replica %d/%d, %d parameter tensors, receives %s, sends %s, starting "
             "from %s", comm.rank, stage, num_stages, replica, num_replicas, len(trainable), info["receives"],
             info["sends"], where)
    rt = StageRuntime(cfg, Path(run_dir), comm, device, threads, state, module, optimizer, trainable, resume,
                      stage=stage, num_stages=num_stages, replica=replica, num_replicas=num_replicas,
                      stage_comm=stage_comm, pipe_comm=pipe_comm, receives=tuple(info["receives"]),
                      sends=tuple(info["sends"]), shared=info.get("shared", {}))
    if rt.shared and device != "cpu":
        raise RuntimeError(f"tied parameters across pipeline stages {sorted(rt.shared)} are summed on the host: "
                           "not supported on CUDA yet; move model.pipeline_cuts so their readers share a stage")
    return rt

