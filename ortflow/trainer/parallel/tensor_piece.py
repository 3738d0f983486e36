"""Tensor (horizontal) parallelism on one rank: its pieces' engine sessions, the all-reduces between them, its update.

Layout: ``rank = replica * hp + t`` (a replica's ``hp`` tensor-parallel ranks are neighbours, so on one host they talk
through shared memory). Two sub-groups: ``tp_comm`` (the ``hp`` ranks of a replica: activation and input-gradient
all-reduces) and ``dp_comm`` (the replicas of tensor-parallel rank ``t``: gradient averaging, as unsplit
data-parallel training does).

One micro-batch runs the rank's pieces (:mod:`ortflow.graph.tensor_pieces`) forward with their eval models, a
parallel piece's outputs summed over ``tp_comm`` (Megatron's ``g``), then backward in reverse order: each piece's
training call recomputes its forward and returns the gradients of what it read, driven by the summed gradients of
what it sent (docs/engine-pipeline.md). A parallel piece's input gradients are partial and are summed over
``tp_comm`` (Megatron's ``f``). Every sum adds the ranks' parts in rank order (an all-gather, then a local sum), so
all ``hp`` ranks hold bitwise the same replicated activations and gradients, hence the same replicated parameters.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow.build.records import GRAD_IN_SUFFIX, piece_dir, read_tensor_record
from ortflow.checkpoints import CheckpointError, h5state
from ortflow.checkpoints.tp import slice_tensor, tp_file
from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer import optim
from ortflow.trainer.comm import Communicator, DeviceBuffer
from ortflow.trainer.optim.zero import Zero0
from ortflow.trainer.parallel.pipeline_stage import stage_session_options
from ortflow.trainer.runtime import Runtime, available_cores, choose_start, optimizer_label, threads_per_rank

log = logging.getLogger("ortflow.trainer")


@dataclass
class PieceRun:
    """One piece's sessions and what it reads and writes (its ``tensor.json`` entry)."""

    info: dict
    state: object
    module: object

    def call(self, train: bool, feeds: dict[str, np.ndarray]) -> list:
        self.module.train() if train else self.module.eval()
        outputs = self.module(*(feeds[n] for n in self.module.input_names()))
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


@dataclass
class TensorRuntime(Runtime):
    """A tensor-parallel rank: the unsplit Runtime's fields (``state``/``module``: the last piece's), plus its place."""

    tp_rank: int = 0
    tp_size: int = 1
    replica: int = 0
    num_replicas: int = 1
    tp_comm: Communicator | None = None
    dp_comm: Communicator | None = None
    pieces: list[PieceRun] = field(default_factory=list)
    slicing: dict[str, list[int]] = field(default_factory=dict)  # sliced parameter -> [axis, parts]
    holders: dict[str, list[int]] = field(default_factory=dict)  # parameter -> pieces holding it (first: owner)
    pipe: tuple[int, int] | None = None  # (stage, P) when it also is a pipeline stage (parallel/pipe_tensor_piece.py)

    def data_shard(self) -> tuple[int, int]:
        """The ``hp`` ranks of a replica read the same batches."""
        return self.replica, self.num_replicas

    def train_state(self) -> h5state.TrainState:
        """This rank's slices (and the replicated parameters), written by the first replica of each tp rank."""
        return h5state.TrainState(
            parameters=self.parameters, trainable=self.trainable, update=self.update,
            optimizer=optimizer_label(self.cfg), rank=self.replica, world_size=self.num_replicas,
            tp=(self.tp_rank, self.tp_size, self.slicing), stage=self.pipe,
        )

    def param(self, name: str):
        return self.pieces[self.holders[name][0]].state.parameters[name]

    def parameters(self) -> dict[str, np.ndarray]:
        names = sorted(self.holders)
        return {n: np.array(self.param(n).data) for n in names}

    def gradient_buffers(self) -> list:
        """The owners' gradient buffers in ``trainable`` order: host views on the CPU, device buffers on CUDA."""
        if self._grads is None:
            if self.device == "cpu":
                self._grads = [self.param(n).grad for n in self.trainable]
            else:
                self._grads = [_device_buffer(self._owner_state(n).get_parameter(n).grad, n) for n in self.trainable]
        return self._grads

    def _owner_state(self, name: str):
        return self.pieces[self.holders[name][0]].state._state  # the engine's C state (device OrtValues)

    # -- the passes ----------------------------------------------------------------------------------------------

    def tp_sum(self, x: np.ndarray) -> np.ndarray:
        """Sum over the tensor-parallel group, added in rank order (bitwise the same on every rank)."""
        if self.tp_size == 1:
            return x
        x = np.ascontiguousarray(x, dtype=np.float32)
        if hasattr(self.tp_comm, "all_gather_device"):
            return self._tp_sum_nccl(x)
        flat = np.zeros(self.tp_size * x.size, np.float32)
        flat[self.tp_rank * x.size : (self.tp_rank + 1) * x.size] = x.reshape(-1)
        self.tp_comm.all_gather(flat, [x.size] * self.tp_size, "tensor-parallel activation sum")
        parts = flat.reshape(self.tp_size, -1)
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total.reshape(x.shape)

    def _tp_sum_nccl(self, x: np.ndarray) -> np.ndarray:
        """:meth:`tp_sum` through NCCL on the GPU (the engine's Python API hands activations over on the host)."""
        cp, comm, n = self.tp_comm._cp, self.tp_comm, x.size
        flat = cp.zeros(self.tp_size * n, cp.float32)
        flat[self.tp_rank * n : (self.tp_rank + 1) * n] = cp.asarray(x.reshape(-1))
        cp.cuda.Device().synchronize()  # the copy (default stream) before NCCL's stream reads it
        comm.all_gather_device(flat.data.ptr + self.tp_rank * n * 4, flat.data.ptr, n)
        # Sync point: the gathered parts are read next.
        comm.group.watched("tensor-parallel all-gather", comm.stream.synchronize)
        parts = flat.reshape(self.tp_size, n)
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return cp.asnumpy(total).reshape(x.shape)

    def forward(self, batch: dict[str, np.ndarray], upto: int) -> dict[str, np.ndarray]:
        """Every piece before ``upto`` forward (eval models); returns what they sent, partial sums summed."""
        env = dict(batch)
        for piece in self.pieces[:upto]:
            sends = piece.info["sends"]
            outputs = piece.call(False, env)[: len(sends)]
            if piece.info["parallel"]:  # Sync point (g): the row-split MatMuls' partial sums
                outputs = [self.tp_sum(y) for y in outputs]
            env.update(zip(sends, outputs, strict=True))
        return env

    def accumulate(self, batches, k: int) -> float:
        """Forward and backward of ``k`` micro-batches (gradients accumulate in the engines); their loss sum."""
        return sum(self.micro_step(next(batches)) for _ in range(k))

    def micro_step(self, batch: dict[str, np.ndarray]) -> float:
        """Forward and backward of one micro-batch; parameter gradients accumulate in the pieces' engines."""
        return self.backward(self.forward(batch, len(self.pieces) - 1))[0]

    def backward(self, env: dict[str, np.ndarray], arriving: dict[str, np.ndarray] | None = None):
        """The pieces' training calls in reverse, on the forward tensors ``env``; ``arriving``: gradients of what the
        last piece sends (a pipeline stage's sends), else the last piece holds the loss. Returns (loss, gradients of
        every received tensor, summed over the tensor-parallel ranks)."""
        grads: dict[str, np.ndarray] = dict(arriving or {})
        loss = 0.0
        for piece in reversed(self.pieces):
            info = piece.info
            feeds = env
            driven = piece is not self.pieces[-1] or arriving is not None
            if driven:  # by the summed gradients of what it sent (zeros if unread)
                given = {n + GRAD_IN_SUFFIX: grads.get(n, np.zeros_like(env[n])) for n in info["float_sends"]}
                feeds = {**env, **given}
            outputs = piece.call(True, feeds)
            if not driven:
                loss = float(outputs[0])
            back = outputs[1 : 1 + len(info["float_receives"])]
            if info["parallel"]:  # Sync point (f): a split region's input gradients are partial
                back = [self.tp_sum(g) for g in back]
            for name, g in zip(info["float_receives"], back, strict=True):
                grads[name] = grads[name] + g if name in grads else np.array(g)
        return loss, grads

    def norm_sq(self, mine: list) -> float:
        """This rank's share of the whole model's squared gradient norm: its slices, and the replicated gradients
        (equal on every tp rank) on tp rank 0 only."""
        counted = [g for g, n in zip(mine, self.trainable, strict=True) if n in self.slicing or self.tp_rank == 0]
        if self.device == "cpu":
            return self.exchange.norm(counted) ** 2
        view = self.dp_comm._device_view  # NCCL's own norm covers every gradient: the subset is summed here
        return float(sum(float((view(g).astype("float64") ** 2).sum()) for g in counted))

    def eval_loss(self, batch: dict[str, np.ndarray]) -> float:
        env = self.forward(batch, len(self.pieces) - 1)
        return float(self.pieces[-1].call(False, env)[0])

    def sum_tied_gradients(self) -> None:
        """A parameter read by several pieces (a tied weight): its owner's gradient becomes the holders' sum."""
        for name, holders in self.holders.items():
            for other in holders[1:]:
                self.param(name).grad[...] += self.pieces[other].state.parameters[name].grad

    def copy_tied_parameters(self) -> None:
        for name, holders in self.holders.items():
            for other in holders[1:]:
                self.pieces[other].state.parameters[name].data[...] = self.param(name).data

    def reset_gradients(self) -> None:
        for piece in self.pieces:
            piece.module.lazy_reset_grad()

    def digest(self, names) -> str:
        h = hashlib.sha256()
        for n in names:
            h.update(np.ascontiguousarray(self.param(n).data))
        return h.hexdigest()


def init_tensor_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str) -> TensorRuntime:
    """Place this rank, load its pieces' artifacts and the state to start from."""
    size = cfg.distributed.horizontal_parallel_size
    record = read_tensor_record(cfg.artifacts_dir)
    if record is None or record["size"] != size:
        raise RuntimeError(f"{cfg.artifacts_dir} holds no tensor-parallel artifacts of size {size}: re-run "
                           f"`ortflow configure` with distributed.horizontal_parallel_size {size}")
    replica, tp_rank = divmod(comm.rank, size)
    # Sync points (collective over the world): the two sub-groups every rank joins.
    tp_comm = comm.split(replica, "tensor-parallel group")
    dp_comm = comm.split(comm.size + tp_rank, "tensor-parallel replica group")
    return assemble_tensor_runtime(TensorRuntime, run_dir, cfg, comm, device, record, Path(cfg.artifacts_dir),
                                   dict(tp_rank=tp_rank, replica=replica, tp_comm=tp_comm, dp_comm=dp_comm))


def assemble_tensor_runtime(cls, run_dir: Path, cfg: RunConfig, comm: Communicator, device: str, record: dict,
                            base: Path, where: dict, pipe: tuple[int, int] | None = None):
    """Load a tensor-parallel rank's pieces (from ``base``, its ``tensor.json`` ``record``) and its starting state.

    Args:
        cls: :class:`TensorRuntime` or a subclass (a pipeline stage's,
            :mod:`ortflow.trainer.parallel.pipe_tensor_piece`).
        where: The rank's ``tp_rank``, ``replica``, ``tp_comm``, ``dp_comm`` (and a subclass's own fields).
        pipe: ``(stage, P)`` on a pipeline stage: its checkpoint files carry the stage too.
    """
    size, tp_rank, replica = cfg.distributed.horizontal_parallel_size, where["tp_rank"], where["replica"]
    resume, warm = choose_start(cfg, comm, pipe[1] if pipe else 1)
    if resume and int(resume.meta.get("horizontal_parallel_size", 1)) != size:
        raise CheckpointError(
            f"checkpoint {resume.path} was written with distributed.horizontal_parallel_size "
            f"{resume.meta.get('horizontal_parallel_size', 1)} but this run has {size}: resume with that size, or "
            "start a new run from it with checkpoint.init_from (its merged weights are sliced for this size)")
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    pieces, holders = [], {}
    for info in record["pieces"]:
        folder = piece_dir(base, tp_rank, info["index"])
        state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                            device=device, session_options=stage_session_options(threads, device))
        for name, _ in state.parameters:
            holders.setdefault(name, []).append(info["index"])
        pieces.append(PieceRun(info, state, module))
    trainable = sorted(n for n, hs in holders.items() if pieces[hs[0]].state.parameters[n].requires_grad)
    dp_exchange = Zero0(where["dp_comm"])
    tied = sorted(n for n, hs in holders.items() if len(hs) > 1)
    if tied and device != "cpu":
        raise RuntimeError(f"parameters read by several tensor-parallel pieces {tied[:5]} (tied weights) are summed on "
                           "the host: not supported on CUDA yet; use horizontal_parallel_size 1 on GPUs for this model")
    rt = cls(cfg, Path(run_dir), comm, device, threads, pieces[-1].state, pieces[-1].module, None, dp_exchange,
             trainable, resume, tp_size=size, num_replicas=comm.size // (size * (pipe[1] if pipe else 1)),
             pieces=pieces, slicing=record["slicing"], holders=holders, pipe=pipe, **where)
    if resume or warm:
        load_sliced_parameters(rt, resume.path if resume else Path(warm))
    rt.update = _build_update(rt, threads)
    if resume:
        own = resume.path / tp_file("optimizer", tp_rank, size, pipe)
        h5state.load_optimizer(resume.path, rt.update, optimizer_label(cfg), rank=replica, files=[own])
    start = f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}" if warm else \
        "the initial weights"
    log.info("rank %d: tensor-parallel rank %d/%d of replica %d/%d%s, %d pieces, %d parameter tensors (%d sliced), "
             "starting from %s", comm.rank, tp_rank, size, replica, rt.num_replicas,
             f" of pipeline stage {pipe[0]}/{pipe[1]}" if pipe else "", len(pieces), len(trainable),
             len(set(trainable) & set(rt.slicing)), start)
    return rt


def _device_buffer(value, name: str) -> DeviceBuffer:
    return DeviceBuffer(value.data_ptr(), int(np.prod(value.shape(), dtype=np.int64)), name)


def _build_update(rt: TensorRuntime, threads: int) -> optim.Update:
    """ortflow's update over this rank's slices and replicated parameters (the owners' buffers)."""
    cfg, trainable = rt.cfg, rt.trainable
    if rt.device == "cpu":
        params = [rt.param(n).data.reshape(-1) for n in trainable]  # writable zero-copy views (CPU engine)
        return optim.build_update(cfg.optimizer, optim.whole_segments(trainable, [p.size for p in params]), params,
                                  threads=threads)
    from ortflow.trainer.optim.device import DeviceUpdate

    # Checked on 2 H200s by tests/gpu/test_gpu_tensor.py (bench/results/gpu-tests-h200x2-w3-tp-pipeline.log).
    params = [_device_buffer(rt._owner_state(n).get_parameter(n).data, n) for n in trainable]
    decay = optim.decays(trainable, cfg.optimizer.no_weight_decay)
    return DeviceUpdate(optim.build_rule(cfg.optimizer), optim.whole_segments(trainable, [p.count for p in params]),
                        [p.ptr for p in params], decay, rt.dp_comm.stream)


def load_sliced_parameters(rt: TensorRuntime, folder: Path) -> None:
    """A checkpoint's whole parameters (a tensor-parallel one's slices merged), this rank's slices into its pieces."""
    values = h5state.read_params(folder)
    missing = sorted(set(rt.holders) - set(values))
    if missing:
        raise CheckpointError(f"{folder.name} does not match the model: missing {missing[:5]}; resume from a "
                              "checkpoint of this model or start a new run")
    for name, holders in rt.holders.items():
        value = values[name]
        if name in rt.slicing:
            axis, parts = rt.slicing[name]
            value = slice_tensor(value, axis, parts, rt.tp_size, rt.tp_rank)
        for k in holders:
            param = rt.pieces[k].state.parameters[name]
            view = param.data
            if view.shape != value.shape:
                raise CheckpointError(f"{folder.name}: {name} has shape {list(value.shape)} for this rank, the "
                                      f"model {list(view.shape)}")
            if rt.device == "cpu":
                view[...] = value  # the CPU engine's buffers are writable views
            else:
                param.data = np.ascontiguousarray(value)  # copied into the engine's device buffer
