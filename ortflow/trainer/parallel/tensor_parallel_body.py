"""Tensor parallelism: the part of a rank that is its tensor-parallel pieces (one of the two bodies a
:class:`~ortflow.trainer.parallel.layout_model.LayoutModel` is built from; the other is
:class:`~ortflow.trainer.parallel.whole_model.WholeModel`).

The rank's tensor-parallel group ``tp_comm`` holds the ``tp`` ranks of one stage of one replica
(:mod:`.parallel_dims`); they are neighbours, so on one host they talk through shared memory. The replicas of a
tensor-parallel rank exchange their gradients through the layout's data-parallel part (any exchange: ZeRO-0, ZeRO-1,
Adasum), and a pipeline stage's pieces go through the stage part's 1F1B schedule.

One micro-batch runs the rank's pieces (:mod:`ortflow.graph.tensor_parallel.tensor_pieces`: a parallel piece is a
replicated prefix, such as a residual add and a norm, then a split region) forward, a parallel piece's partial sums
summed over ``tp_comm`` (Megatron's ``g``; the replicated tensors its prefix sends are the same on every rank), then
backward in reverse order: each piece's training call returns the gradients of what it read, driven by the gradients
of what it sent (a piece that kept its activations runs its backward alone; others recompute their forward;
docs/engine.md). A parallel piece's input gradients are partial and are summed over ``tp_comm`` (Megatron's ``f``);
so that the prefix's full part is counted once in that sum, the arriving gradients of its replicated sends are fed
divided by ``tp``. The gradients of the prefix's parameters (``replicated_parameters``) mix the same parts and are
summed over ``tp_comm`` once per update, before the tied-weight sums, the clip and the update. Every sum adds the
ranks' parts in rank order (an all-gather, then a local sum), so all ``tp`` ranks hold bitwise the same replicated
activations and gradients, hence the same replicated parameters. On CUDA ranks the activations, their gradients and
the sums stay on the GPU (:mod:`.activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow.artifacts_folder import GRAD_IN_SUFFIX, piece_dir
from ortflow.checkpoints import CheckpointError, h5state
from ortflow.engine import api
from ortflow.tensor_slices import merge_slices, slice_tensor
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.parallel.activations import DeviceTensors, HostTensors
from ortflow.trainer.rank_model import EnginePart, sha256_of


@dataclass
class PieceRun(EnginePart):
    """One piece's sessions and what it reads and writes (its ``tensor.json`` entry)."""

    info: dict = field(default_factory=dict)


@dataclass
class TensorParallel:
    """A rank's tensor-parallel pieces (of the whole model or of its pipeline stage) and its place in ``tp_comm``."""

    pieces: list[PieceRun]
    holders: dict[str, list[int]]  # parameter -> pieces holding it (first: owner)
    trainable: list[str]
    slicing: dict[str, list[int]]  # sliced parameter -> [axis, parts]
    buffers: HostBuffers | DeviceBuffers
    tp_rank: int
    tp_size: int
    tp_comm: Communicator
    tensors: HostTensors | DeviceTensors | None = None  # where the pieces' activations live (.activations)
    #: Sums over ranks are added in rank order: the tp ranks' replicated tensors stay bitwise equal.
    rank_order = True
    _piece_grads: list[dict] = field(default_factory=list)  # pinned gradient buffers, per piece
    _grads: list | None = None

    @property
    def state(self):
        """The last piece's state (the one the loss comes from)."""
        return self.pieces[-1].state

    @property
    def module(self):
        """The last piece's module."""
        return self.pieces[-1].module

    @property
    def counts_loss(self) -> bool:
        """Every tp rank computes the same loss: tp rank 0's counts."""
        return self.tp_rank == 0

    def param(self, name: str):
        return self.pieces[self.holders[name][0]].state.parameters[name]

    def parameters(self) -> dict[str, np.ndarray]:
        names = sorted(self.holders)
        return {n: np.array(self.param(n).data) for n in names}

    def engine_parts(self) -> list[EnginePart]:
        return self.pieces

    def parameter_buffers(self) -> list:
        """The owners' parameter buffers in ``trainable`` order (what the update writes)."""
        return [self.param_buffer(self.holders[n][0], n) for n in self.trainable]

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
            partial = piece.info["partial_sends"]
            if partial:  # Sync point (g): the row-split MatMuls' partial sums (replicated sends are not summed)
                outputs = [self.tp_sum(y) if n in partial else y for n, y in zip(sends, outputs, strict=True)]
            env.update(zip(sends, outputs, strict=True))
        return env

    def grad_view(self, piece: int, name: str):
        """Piece ``piece``'s gradient buffer of ``name`` (pinned at start: a profiling module swaps what the state
        returns)."""
        if not self._piece_grads:
            self._piece_grads = [self.buffers.gradients(part.state) for part in self.pieces]
        return self._piece_grads[piece][name]

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
                back = piece.kept.backward([self._arriving(info, n, grads, env) for n in info["sends"]])
                same = piece.kept.same_input_grads  # of the gradient graph that computed them
            else:
                same = info.get("same_gradient", {})  # of its training model (configure's record)
                if driven:  # by the summed gradients of what it sent (zeros if unread)
                    given = {n + GRAD_IN_SUFFIX: self._arriving(info, n, grads, env) for n in info["float_sends"]}
                    feeds = {**env, **given}
                outputs = self.tensors.call(piece, True, feeds)
                if not driven:
                    loss = self.tensors.scalar(outputs[0])
                back = outputs[1 : 1 + len(info["float_receives"])]
            if info["parallel"]:  # Sync point (f): a split region's input gradients are partial
                back = self._summed(info["float_receives"], back, same)
            for name, g in zip(info["float_receives"], back, strict=True):
                grads[name] = self.tensors.add(grads[name], g) if name in grads else self.tensors.own(g)
        self.tensors.settle()  # Sync point (once per micro-batch): the exchange and the update read on other streams
        return loss, grads

    def _summed(self, receives: list[str], back: list, same: dict[str, str]) -> list:
        """A parallel piece's input gradients ``back`` (in ``receives`` order), each summed over the tensor-parallel
        ranks; a received tensor whose gradient is the same tensor as an earlier one's (``same``: the residual stream
        and the product added to it) takes that one's sum instead of a second sum of the same values."""
        sums: dict[str, object] = {}
        for name, g in zip(receives, back, strict=True):
            if name in same:  # the same values (possibly in another shape: a Gemm's flattened tokens)
                sums[name] = self.tensors.reshaped_like(sums[same[name]], g)
            else:
                sums[name] = self.tp_sum(g, "tensor-parallel input-gradient sum")
        return [sums[name] for name in receives]

    def _arriving(self, info: dict, name: str, grads: dict, env: dict):
        """The gradient a piece's backward is fed for its send ``name`` (zeros if nothing read it): a parallel
        piece's replicated send's divided by ``tp``, as each rank's backward then adds a ``1/tp`` share of the
        prefix's full part to its partial part, and the sums over ``tp_comm`` count it once (exact for ``tp`` a power
        of two)."""
        if name not in grads:
            return self.tensors.zeros_like(env[name])
        if info["parallel"] and self.tp_size > 1 and name not in info["partial_sends"]:
            return self.tensors.scale(grads[name], 1.0 / self.tp_size)
        return grads[name]

    def counts_in_norm(self, name: str) -> bool:
        """Whether this rank counts ``name``'s gradient in the norm: its slices, and the replicated gradients
        (equal on every tp rank) on tp rank 0 only."""
        return name in self.slicing or self.tp_rank == 0

    def eval_loss(self, batch: dict[str, np.ndarray]) -> float:
        env = self.forward(batch, len(self.pieces) - 1)
        return self.tensors.scalar(self.tensors.call(self.pieces[-1], False, env)[0])

    def sum_tied_gradients(self) -> None:
        """First a parallel piece's replicated parameters' gradients (partial: :meth:`sum_replicated_gradients`),
        then a parameter read by several pieces (a tied weight): its owner's gradient becomes the holders' sum, added
        in piece order (float32 adds where the buffers live: the same bits on the host and on a GPU)."""
        self.sum_replicated_gradients()
        view = self.buffers.view
        with self.buffers.passes():
            for name, holders in self._tied():
                owner = view(self.grad_view(holders[0], name))
                for other in holders[1:]:
                    owner += view(self.grad_view(other, name))

    def sum_replicated_gradients(self) -> None:
        """Each parallel piece's gradients of its replicated parameters (its prefix's norm weights) summed over
        ``tp_comm``, piece by piece (a tied weight's other holders' gradients are full), added in rank order: then
        they are equal on every tp rank, like every replicated gradient, and counted in the norm on tp rank 0."""
        if self.tp_size == 1:
            return
        trained = set(self.trainable)
        buffers = [self.grad_view(k, name) for k, piece in enumerate(self.pieces)
                   for name in piece.info["replicated_parameters"] if name in trained]
        with self.buffers.passes():  # Sync point (f, per update): partial parameter gradients
            self.tensors.sum_into(buffers, "tensor-parallel replicated-gradient sum")

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

    def after_update(self) -> None:
        """A tied weight's new value into every piece that reads it; the engines' gradient sums start again."""
        self.copy_tied_parameters()
        self.reset_gradients()

    def reset_gradients(self) -> None:
        for piece in self.pieces:
            piece.module.lazy_reset_grad()
            if piece.kept is not None:
                piece.kept.reset()

    def digest(self, names) -> str:
        return sha256_of(self.param(n).data for n in names)

    # -- a pipeline stage's passes (the stage part's forward and backward) ------------------------------------------

    def stage_forward(self, feeds: dict[str, np.ndarray], sends: tuple[str, ...], train: bool) -> list[np.ndarray]:
        """A middle stage's forward: every piece (partial sums summed); ``feeds`` keeps what the pieces passed each
        other (on CUDA ranks on the GPU) for the backward. Tensor-parallel pieces hold no BatchNorm (validate and the
        ranks refuse it); a training micro-batch's pieces keep their activations where they keep them."""
        feeds.update(self.forward(feeds, len(self.pieces), train=train))
        return [self.tensors.host(feeds[n]) for n in sends]  # the pipeline sends host arrays

    def stage_backward(self, feeds: dict[str, np.ndarray], grads: list[np.ndarray] | None, sends: tuple[str, ...],
                       receives: tuple[str, ...]) -> tuple[float, list]:
        """The pieces' backward (the last stage first runs its forward); returns (loss, gradients of what the stage
        received, summed over the tensor-parallel ranks)."""
        if grads is None:
            env, arriving = self.forward(feeds, len(self.pieces) - 1, train=True), None
        else:
            env, arriving = feeds, dict(zip(sends, grads, strict=True))
        loss, back = self.backward(env, arriving)
        tensors = self.tensors
        return loss, [tensors.host(back[n] if n in back else tensors.zeros_like(env[n])) for n in receives]

    def train_mode(self) -> None:
        for piece in self.pieces:
            piece.module.train()

    # -- checkpoints and checks ------------------------------------------------------------------------------------

    def replica_checks(self, dp: Communicator, label: str) -> tuple[list, str]:
        """Replicated parameters are bitwise equal on the tp ranks, and each rank's slices on its replicas."""
        replicated = self.digest(sorted(n for n in self.holders if n not in self.slicing))
        whole = self.digest(sorted(self.holders))
        return [(replicated, self.tp_comm, "replicated parameter digest"),
                (whole, dp, "tensor-parallel replica digest")], f"{whole} (replicated {replicated})"

    def whole(self, names) -> dict[str, np.ndarray] | None:
        """The trained parameters whose names pass ``names``, slices merged over the tp ranks, on tp rank 0 (None on
        the others; collective over the tp group)."""
        mine = {n: np.array(self.param(n).data) for n in self.trainable if names(n)}
        slices = self.tp_comm.gather_object(mine, "gather slices for histograms")
        if slices is None:
            return None
        return {n: merge_slices([s[n] for s in slices], *self.slicing[n]) if n in self.slicing else v
                for n, v in slices[0].items()}

    def tp_state(self) -> tuple[int, int, dict]:
        """``(tp rank, tp size, slicing)`` for its checkpoint files."""
        return self.tp_rank, self.tp_size, self.slicing

    def most_kept(self) -> int | None:
        return None


def load_pieces(record: dict, base: Path, tp_rank: int, device: str, options) -> tuple[list[PieceRun], dict]:
    """Tensor-parallel rank ``tp_rank``'s pieces (of ``base``, its ``tensor.json`` ``record``): their sessions, and
    which pieces hold each parameter."""
    pieces, holders = [], {}
    for info in record["pieces"]:
        if "partial_sends" not in info:
            raise ValueError(f"{base} holds tensor-parallel pieces without partial_sends in their record (each "
                               "replicated level its own piece): re-run `ortflow configure` to rebuild them")
        folder = piece_dir(base, tp_rank, info["index"])
        state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                            device=device, session_options=options)
        for name, _ in state.parameters:
            holders.setdefault(name, []).append(info["index"])
        pieces.append(PieceRun(state, module, folder, info=info))
    return pieces, holders


def load_sliced_parameters(rt: TensorParallel, folder: Path) -> None:
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
