"""Tensor (horizontal) parallelism on one rank (a :class:`~ortflow.trainer.rank_model.RankModel`): its pieces' engine
sessions, the all-reduces between them, its update.

Layout (:mod:`.parallel_dims` with ``pp = 1``): ``rank = replica * hp + t`` (a replica's ``hp`` tensor-parallel ranks
are neighbours, so on one host they talk through shared memory). Two sub-groups: ``tp_comm`` (the ``hp`` ranks of a
replica: activation and input-gradient all-reduces) and ``dp_comm`` (the replicas of tensor-parallel rank ``t``:
gradient averaging, as unsplit data-parallel training does).

One micro-batch runs the rank's pieces (:mod:`ortflow.graph.tensor_parallel.tensor_pieces`) forward with their eval
models, a parallel piece's outputs summed over ``tp_comm`` (Megatron's ``g``), then backward in reverse order: each
piece's training call recomputes its forward and returns the gradients of what it read, driven by the summed gradients
of what it sent (docs/engine.md). A parallel piece's input gradients are partial and are summed over
``tp_comm`` (Megatron's ``f``). Every sum adds the ranks' parts in rank order (an all-gather, then a local sum), so
all ``hp`` ranks hold bitwise the same replicated activations and gradients, hence the same replicated parameters.
On CUDA ranks the activations, their gradients and the sums stay on the GPU (:mod:`.activations`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow.artifacts_folder import GRAD_IN_SUFFIX, piece_dir, read_tensor_record
from ortflow.checkpoints import CheckpointError, h5state
from ortflow.checkpoints.tp import merge_slices, slice_tensor, tp_file
from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import engine_buffers
from ortflow.trainer.optim.rank_update import whole_update
from ortflow.trainer.optim.zero import Zero0
from ortflow.trainer.parallel.activations import DeviceTensors, HostTensors, activation_store
from ortflow.trainer.parallel.kept_activations import keep_piece_activations
from ortflow.trainer.parallel.parallel_dims import ParallelDims, make_groups
from ortflow.trainer.parallel.pipeline_stage import stage_session_options
from ortflow.trainer.parallel.replica import Runtime
from ortflow.trainer.rank_model import EnginePart, Reduced, compare_digests, sha256_of
from ortflow.trainer.startup import available_cores, choose_start, optimizer_label, threads_per_rank
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")


@dataclass
class PieceRun(EnginePart):
    """One piece's sessions and what it reads and writes (its ``tensor.json`` entry)."""

    info: dict = field(default_factory=dict)


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
    tensors: HostTensors | DeviceTensors | None = None  # where the pieces' activations live (.activations)
    _piece_grads: list[dict] = field(default_factory=list)  # pinned gradient buffers, per piece

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

    def engine_parts(self) -> list[EnginePart]:
        return self.pieces

    def gradient_buffers(self) -> list:
        """The owners' gradient buffers in ``trainable`` order (:mod:`ortflow.trainer.comm.engine_buffers`)."""
        if self._grads is None:
            self._grads = [self.grad_view(self.holders[n][0], n) for n in self.trainable]
        return self._grads

    def param_buffer(self, piece: int, name: str):
        """Piece ``piece``'s parameter buffer of ``name``."""
        return self.buffers.parameters(self.pieces[piece].state, [name])[0]

    # -- the passes ----------------------------------------------------------------------------------------------

    def tp_sum(self, x, label: str = "tensor-parallel activation sum"):
        """Sum over the tensor-parallel group, added in rank order (bitwise the same on every rank), where the rank
        keeps its activations (:mod:`.activations`)."""
        if self.tp_size == 1:
            return x
        return self.tensors.sum(x, label)

    def forward(self, batch: dict[str, np.ndarray], upto: int, train: bool = False) -> dict[str, np.ndarray]:
        """Every piece before ``upto`` forward (of a training micro-batch: ``train``, its activations kept where the
        piece keeps them; else eval models); returns what they sent, partial sums summed (with ``batch``, where the
        rank keeps its activations)."""
        env = self.tensors.adopt(batch)
        for piece in self.pieces[:upto]:
            sends = piece.info["sends"]
            if train and piece.kept is not None:
                outputs = piece.kept.forward(env)
            else:
                outputs = self.tensors.call(piece, False, env)[: len(sends)]
            if piece.info["parallel"]:  # Sync point (g): the row-split MatMuls' partial sums
                outputs = [self.tp_sum(y) for y in outputs]
            env.update(zip(sends, outputs, strict=True))
        return env

    def grad_view(self, piece: int, name: str):
        """Piece ``piece``'s gradient buffer of ``name`` (pinned at start: a profiling module swaps what the state
        returns)."""
        if not self._piece_grads:
            self._piece_grads = [self.buffers.gradients(part.state) for part in self.pieces]
        return self._piece_grads[piece][name]

    def accumulate(self, batches, k: int, timer: PhaseTimer | None = None) -> float:
        """Forward and backward of ``k`` micro-batches (gradients accumulate in the engines); their loss sum."""
        loss_sum = 0
        for _ in range(k):
            batch = next(batches)
            if timer is not None:
                timer.lap("data")
            loss_sum += self.micro_step(batch)
            if timer is not None:
                timer.lap("forward_backward")
        return loss_sum

    def micro_step(self, batch: dict[str, np.ndarray]) -> float:
        """Forward and backward of one micro-batch; parameter gradients accumulate in the pieces' engines."""
        return self.backward(self.forward(batch, len(self.pieces) - 1, train=True))[0]

    def backward(self, env: dict[str, np.ndarray], arriving: dict[str, np.ndarray] | None = None):
        """The pieces' training calls in reverse, on the forward tensors ``env``; ``arriving``: gradients of what the
        last piece sends (a pipeline stage's sends), else the last piece holds the loss. Returns (loss, gradients of
        every received tensor, summed over the tensor-parallel ranks)."""
        grads = self.tensors.adopt(arriving or {})
        loss = 0.0
        for piece in reversed(self.pieces):
            info = piece.info
            feeds = env
            driven = piece is not self.pieces[-1] or arriving is not None
            if piece.kept is not None and piece.kept.in_flight():  # its forward kept the activations
                back = piece.kept.backward([grads[n] if n in grads else self.tensors.zeros_like(env[n])
                                            for n in info["sends"]])
            else:
                if driven:  # by the summed gradients of what it sent (zeros if unread)
                    given = {n + GRAD_IN_SUFFIX: grads[n] if n in grads else self.tensors.zeros_like(env[n])
                             for n in info["float_sends"]}
                    feeds = {**env, **given}
                outputs = self.tensors.call(piece, True, feeds)
                if not driven:
                    loss = self.tensors.scalar(outputs[0])
                back = outputs[1 : 1 + len(info["float_receives"])]
            if info["parallel"]:  # Sync point (f): a split region's input gradients are partial
                back = [self.tp_sum(g, "tensor-parallel input-gradient sum") for g in back]
            for name, g in zip(info["float_receives"], back, strict=True):
                grads[name] = self.tensors.add(grads[name], g) if name in grads else self.tensors.own(g)
        return loss, grads

    def counts_in_norm(self, name: str) -> bool:
        """Whether this rank counts ``name``'s gradient in the norm: its slices, and the replicated gradients
        (equal on every tp rank) on tp rank 0 only."""
        return name in self.slicing or self.tp_rank == 0

    def norm_sq(self, mine: list) -> float:
        """This rank's share of the whole model's squared gradient norm (:meth:`counts_in_norm`)."""
        counted = [g for g, n in zip(mine, self.trainable, strict=True) if self.counts_in_norm(n)]
        return self.dp_comm.sum_squares(counted)  # the exchange's own norm covers every gradient: a subset here

    def eval_loss(self, batch: dict[str, np.ndarray]) -> float:
        env = self.forward(batch, len(self.pieces) - 1)
        return self.tensors.scalar(self.tensors.call(self.pieces[-1], False, env)[0])

    def sum_tied_gradients(self) -> None:
        """A parameter read by several pieces (a tied weight): its owner's gradient becomes the holders' sum, added in
        piece order (float32 adds where the buffers live: the same bits on the host and on a GPU)."""
        view = self.buffers.view
        with self.buffers.passes():
            for name, holders in self._tied():
                owner = view(self.grad_view(holders[0], name))
                for other in holders[1:]:
                    owner += view(self.grad_view(other, name))

    def copy_tied_parameters(self) -> None:
        """After an update, the owner's new value of a tied weight into the other pieces that read it."""
        view = self.buffers.view
        with self.buffers.passes():
            for name, holders in self._tied():
                for other in holders[1:]:
                    view(self.param_buffer(other, name))[...] = view(self.param_buffer(holders[0], name))

    def _tied(self) -> list[tuple[str, list[int]]]:
        """Trained parameters read by several pieces (a frozen one, such as RoPE's frequencies or a dynamo export's
        shared exponent of the RMSNorms' Pow, has no gradient and never changes)."""
        trained = set(self.trainable)
        return [(name, holders) for name, holders in self.holders.items() if len(holders) > 1 and name in trained]

    def reset_gradients(self) -> None:
        for piece in self.pieces:
            piece.module.lazy_reset_grad()
            if piece.kept is not None:
                piece.kept.reset()

    def digest(self, names) -> str:
        return sha256_of(self.param(n).data for n in names)

    # -- the rank model ------------------------------------------------------------------------------------------

    def reduce(self, k: int, loss_sum: float, stop: bool) -> Reduced:
        """Tied weights summed within the rank; each tensor-parallel rank's replicas average its gradients (the
        unsplit exchange, per tp rank); loss, stop and the norm shares summed in rank order over every rank."""
        self.sum_tied_gradients()
        mine = self.exchange.reduce(self.gradient_buffers(), k * self.num_replicas, np.zeros(0, np.float32))
        norm_sq = self.norm_sq(mine) if self.replica == 0 else 0.0  # the replicated gradients counted once
        local = np.array([loss_sum / k if self.tp_rank == 0 else 0.0, float(stop), norm_sq])
        # Sync point: loss, stop flag and gradient norm, added in rank order: bitwise the same on every rank.
        scalars = self.comm.allgather_sum(local, "tensor-parallel loss, stop, norm")
        return Reduced(mine, float(scalars[0]) / self.num_replicas, bool(scalars[1]), float(scalars[2]))

    def grad_norm(self, reduced: Reduced) -> float:
        return float(np.sqrt(reduced.norm_sq))

    def after_update(self) -> None:
        self.copy_tied_parameters()
        self.reset_gradients()

    def eval_sums(self, eval_batches) -> np.ndarray:
        """Every tp rank computes the same loss: tp rank 0's counts."""
        sums = np.zeros(2)
        for batch, weight, rows in eval_batches():
            sums += (self.eval_loss(batch) * weight, rows)
        for piece in self.pieces:
            piece.module.train()
        return sums if self.tp_rank == 0 else np.zeros(2)

    def sum_scalars(self, values: np.ndarray, label: str) -> np.ndarray:
        return self.comm.allgather_sum(values, label)  # rank order: bitwise the same on every rank

    def replica_check(self, step: int) -> dict:
        """Replicated parameters are bitwise equal on the tp ranks, and each rank's slices on its replicas."""
        replicated = self.digest(sorted(n for n in self.holders if n not in self.slicing))
        whole = self.digest(sorted(self.holders))
        compare_digests(self, step, [(replicated, self.tp_comm, "replicated parameter digest"),
                                     (whole, self.dp_comm, "tensor-parallel replica digest")],
                        f"{whole} (replicated {replicated})")
        return {}

    def layout_meta(self) -> dict:
        return {"horizontal_parallel_size": self.tp_size, "pipeline_parallel_size": self.pipe[1] if self.pipe else 1}

    def whole_parameters(self, names) -> dict[str, np.ndarray] | None:
        """The model's parameters on rank 0: slices merged over the tp ranks of replica 0 (then, on a pipeline, the
        stages gathered); collective over those ranks."""
        if self.replica != 0:
            return None
        mine = {n: np.array(self.param(n).data) for n in self.trainable if names(n)}
        slices = self.tp_comm.gather_object(mine, "gather slices for histograms")
        if slices is None:
            return None
        merged = {n: merge_slices([s[n] for s in slices], *self.slicing[n]) if n in self.slicing else v
                  for n, v in slices[0].items()}
        if self.pipe is None:
            return merged
        parts = self.pipe_comm.gather_object(merged, "gather parameters for histograms")
        return {n: v for part in parts for n, v in part.items()} if parts is not None else None

    def finish(self) -> None:
        """Nothing measured beyond the loop's step-time breakdown."""


def init_tensor_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str,
                        dims: ParallelDims) -> TensorRuntime:
    """Place this rank, load its pieces' artifacts and the state to start from."""
    size = dims.tp
    record = read_tensor_record(cfg.artifacts_dir)
    if record is None or record["size"] != size:
        raise RuntimeError(f"{cfg.artifacts_dir} holds no tensor-parallel artifacts of size {size}: re-run "
                           f"`ortflow configure` with distributed.horizontal_parallel_size {size}")
    where, groups = make_groups(comm, dims)  # Sync points (collective over the world): the sub-groups it joins
    return assemble_tensor_runtime(TensorRuntime, run_dir, cfg, comm, device, record, Path(cfg.artifacts_dir),
                                   dict(tp_rank=where.tp_rank, replica=where.replica, tp_comm=groups.tp,
                                        dp_comm=groups.dp, dims=dims))


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
    buffers = engine_buffers(device, where["dp_comm"])  # on CUDA, worked on on the replicas' NCCL stream
    pieces, holders = [], {}
    for info in record["pieces"]:
        folder = piece_dir(base, tp_rank, info["index"])
        state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                            device=device, session_options=stage_session_options(threads, buffers))
        for name, _ in state.parameters:
            holders.setdefault(name, []).append(info["index"])
        pieces.append(PieceRun(state, module, folder, info=info))
    trainable = sorted(n for n, hs in holders.items() if pieces[hs[0]].state.parameters[n].requires_grad)
    dp_exchange = Zero0(where["dp_comm"])
    rt = cls(cfg, Path(run_dir), comm, device, threads, pieces[-1].state, pieces[-1].module, None, dp_exchange,
             trainable, resume, tp_size=size, num_replicas=comm.size // (size * (pipe[1] if pipe else 1)),
             pieces=pieces, slicing=record["slicing"], holders=holders, pipe=pipe, buffers=buffers, **where)
    if resume or warm:
        load_sliced_parameters(rt, resume.path if resume else Path(warm))
    rt.tensors = activation_store(buffers, rt.tp_comm, tp_rank, size)
    params = [rt.param_buffer(holders[n][0], n) for n in trainable]  # the owners' buffers
    rt.update = whole_update(cfg, rt.dp_comm, trainable, params, buffers, threads)
    rt.gradient_buffers()  # pinned now: the tied-gradient sums and a profiling module read these
    if not cfg.distributed.recompute_forward and not buffers.on_device:  # CUDA ranks recompute
        keep_piece_activations(rt.pieces, pipe is None or pipe[0] == pipe[1] - 1,
                               stage_session_options(threads, buffers, cfg.distributed.deterministic_compute),
                               cfg.distributed.recompute_subgraphs)
    if resume:
        own = resume.path / tp_file("optimizer", tp_rank, size, pipe)
        h5state.load_optimizer(resume.path, rt.update, optimizer_label(cfg), rank=replica, files=[own])
    start = f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}" if warm else \
        "the initial weights"
    log.info("rank %d: tensor-parallel rank %d/%d of replica %d/%d%s, %d pieces (%d keep their activations), %d "
             "parameter tensors (%d sliced), starting from %s", comm.rank, tp_rank, size, replica, rt.num_replicas,
             f" of pipeline stage {pipe[0]}/{pipe[1]}" if pipe else "", len(pieces),
             sum(p.kept is not None for p in pieces), len(trainable), len(set(trainable) & set(rt.slicing)), start)
    return rt


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
            rt.buffers.write(param, value)
