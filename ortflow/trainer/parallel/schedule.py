"""The pipeline schedule (1F1B with activation recomputation) of a pipeline stage, and its eval forward pass.

Micro-batches are ``train.gradient_accumulation_steps``. Stage ``s`` of ``P`` runs ``min(P - s - 1, m)`` forward
passes (warm-up), then alternates one forward and one backward, then drains the remaining backwards (1F1B, as in
PipeDream-Flush / Megatron). A forward runs the stage's eval model (nothing kept); the backward call recomputes the
forward, so a stage holds one micro-batch's activations at a time and, between its forward and backward passes,
only the tensors it received (at most ``P - s`` micro-batches of them). GPipe would hold all ``m`` received inputs
and gains nothing here: with recomputation both schedules compute the same and 1F1B keeps less.

The messages go over ``rt.messages``: the process group (MPI ``Isend``/``Recv`` of host arrays) on CPU ranks and
pipeline x tensor-parallel stages, or on CUDA stages with NCCL a :class:`~ortflow.trainer.comm.device_pipe.DevicePipe`
(device tensors, NCCL point-to-point, one stream per direction and neighbour). Either way sends are queued and return,
and receives block under the watchdog in schedule order, so no pair of stages waits on each other; the label of a
stalled receive names the stage and rank it waits for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ortflow.trainer.comm.device_pipe import P2P_TYPES

log = logging.getLogger("ortflow.trainer")

#: Point-to-point message tags: activations go forward, gradients come back, tied-weight gradients between holders.
ACT_TAG, GRAD_TAG, TIED_TAG = 1, 2, 3


def one_f_one_b(stage: int, num_stages: int, num_micro: int) -> list[tuple[str, int]]:
    """The order of a stage's passes: ("F", i) forward of micro-batch i, ("B", i) its backward.

    The last stage's forward and backward are one engine call, listed as ("B", i) alone.
    """
    if stage == num_stages - 1:
        return [("B", i) for i in range(num_micro)]
    warmup = min(num_stages - stage - 1, num_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_micro - warmup, num_micro)]


@dataclass
class StepStats:
    """What one pipeline step did on this rank (the bench reads it; the loop uses the loss).

    Attributes:
        loss_sum: Sum of the micro-batch losses on the last stage, else 0.0.
        most_held: The most micro-batches whose received inputs were held at once.
        held_bytes: Bytes of received inputs held at that moment (the stage's only stashed activations).
        sent_bytes: The most bytes of sent tensors (activations, gradients) whose buffers this rank still held after a
            pass: the sends not yet known to be received (MPI's or a DevicePipe's; 0 where the communicator does not
            say).
        compute_s: Seconds inside the engine's forward/backward calls (the rest of the step is waiting/transfer).
    """

    loss_sum: float = 0.0
    most_held: int = 0
    held_bytes: int = 0
    sent_bytes: int = 0
    compute_s: float = 0.0


def pipeline_step(rt, batches: Iterator[dict[str, np.ndarray]], k: int,
                  clock: Callable[[], float] = time.perf_counter, timer=None) -> StepStats:
    """Forward and backward passes of ``k`` micro-batches through the pipeline; gradients accumulate in the engine.

    ``rt`` speaks the stage protocol (``stage``, ``num_stages``, ``last``, ``messages``, ``receives``, ``sends``,
    ``forward``, ``backward``): a :class:`~.pipeline_stage.PipelineStage` over a whole stage or its tensor-parallel
    pieces.
    ``timer`` (a :class:`~ortflow.trainer.timing.PhaseTimer`) is charged the wait for the micro-batches as ``data``.
    """
    pipe, stage = rt.messages, rt.stage
    micro = [next(batches) for _ in range(k)]
    if timer is not None:
        timer.lap("data")
    held: dict[int, dict[str, np.ndarray]] = {}
    stats = StepStats()
    recycle = getattr(pipe, "recycle", None)  # a DevicePipe reuses the received tensors a backward pass is done with
    for kind, i in one_f_one_b(stage, rt.num_stages, k):
        if i not in held:  # receive (or, on stage 0, take from the batch) this micro-batch's inputs
            feeds = dict(micro[i])
            for name in rt.receives:
                feeds[name] = pipe.recv(stage - 1, ACT_TAG, f"recv act mb{i} <- stage {stage - 1}")
            held[i] = feeds
            if len(held) > stats.most_held:
                stats.most_held = len(held)
                stats.held_bytes = sum(message_bytes(f[n]) for f in held.values() for n in rt.receives)
        started = clock()
        if kind == "F":
            outputs = rt.forward(held[i])
            stats.compute_s += clock() - started
            for y in outputs:
                pipe.send(y, stage + 1, ACT_TAG)
            stats.sent_bytes = max(stats.sent_bytes, pipe.pending_send_bytes())
            continue
        grads = None
        if not rt.last:
            grads = [pipe.recv(stage + 1, GRAD_TAG, f"recv grad mb{i} <- stage {stage + 1}") for _ in rt.sends]
            started = clock()
        feeds = held.pop(i)
        loss, back = rt.backward(feeds, grads)
        stats.compute_s += clock() - started
        if recycle is not None:
            recycle([feeds[n] for n in rt.receives] + list(grads or []))
        if rt.last:
            stats.loss_sum += loss
        for g in back:
            pipe.send(g, stage - 1, GRAD_TAG)
        stats.sent_bytes = max(stats.sent_bytes, pipe.pending_send_bytes())
    # Sync point: the sent tensors' buffers must outlive their sends; a stalled peer shows here.
    pipe.wait_sends(f"pipeline sends of stage {stage}")
    return stats


def message_bytes(x) -> int:
    """Bytes of a received tensor: a host array, or a device tensor (``OrtValue``: its shape and element type, one of
    the types a :class:`~ortflow.trainer.comm.device_pipe.DevicePipe` carries)."""
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    return int(np.prod(x.shape(), dtype=np.int64)) * np.dtype(P2P_TYPES[x.data_type()][0]).itemsize


def sum_tied_gradients(rt) -> None:
    """Every holder of a tied parameter ends with the sum of all holders' gradients, added in stage order on each, so
    the sums (and then the copies after the update) are bitwise equal on every holder."""
    if rt.shared:
        sum_across_stages(rt.pipe_comm, rt.stage, rt.shared, rt.grad_view)


def sum_across_stages(pipe, stage: int, shared: dict[str, list[int]], grad_of: Callable) -> None:
    """The tied-gradient sum over a pipeline group: ``shared`` maps each tied parameter this stage holds to every
    holding stage; ``grad_of(name)`` is its gradient buffer here (a tensor-parallel rank's slice under pipeline x
    tensor parallelism: every holder slices it alike): a writable host array, or on GPU ranks the engine's device
    buffer, copied to the host and back through ``pipe`` (one tied table per update).

    The host copies travel over the process group (``pipe.host``), whose sends do not wait for their receiver: every
    holder sends first, then receives.
    """
    link = pipe.host
    parts = {}
    for name, holders in sorted(shared.items()):
        mine = pipe.copy_to_host(grad_of(name))
        parts[name] = {stage: mine}
        for other in holders:
            if other != stage:
                link.send(mine, other, TIED_TAG)
    for name, holders in sorted(shared.items()):
        for other in holders:
            if other != stage:
                parts[name][other] = link.recv(other, TIED_TAG, f"recv tied grad {name[:20]} <- stage {other}")
        total = parts[name][holders[0]].copy()
        for other in holders[1:]:
            total += parts[name][other]
        pipe.copy_from_host(grad_of(name), total)
    # Sync point: the sent copies must outlive their sends.
    link.wait_sends("tied gradient sends")


def stage_eval_sums(rt, eval_batches) -> np.ndarray:
    """``[weighted loss sum, rows]`` per eval batch (``num_batches x 2``): each replica's stages pass its eval batches
    forward; the last stage computes the loss (zeros on the other stages, and on all but one tensor-parallel rank of a
    pp x tp last stage).

    ``eval_batches.weighted_batches()`` yields ``(batch index, feeds, weight, rows)`` as for the unsplit loop (padded
    batches weighted so that every real row counts once).
    """
    pipe, stage = rt.messages, rt.stage
    sums = np.zeros((eval_batches.num_batches, 2))
    for n, (k, batch, weight, rows) in enumerate(eval_batches.weighted_batches()):
        feeds = dict(batch)
        for name in rt.receives:
            feeds[name] = pipe.recv(stage - 1, ACT_TAG, f"recv eval act {n} <- stage {stage - 1}")
        if rt.last:
            loss = rt.eval_loss(feeds)
            if rt.counts_loss:  # of a pp x tp last stage's tp ranks (same loss), one counts
                sums[k] += (loss * weight, rows)
        else:
            for y in rt.forward(feeds, train=False):
                pipe.send(y, stage + 1, ACT_TAG)
        pipe.wait_sends("pipeline eval sends")
    rt.train_mode()
    return sums


def log_stage_timing(rt, timing: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Log this rank's median update time and the idle share of it (waiting on other stages: the bubble and the
    transfers); the first update (warm-up) is left out when there are more. Returns (step s, engine s) or None."""
    if not timing:
        return None
    kept = timing[1:] or timing
    step_s = float(np.median([t for t, _ in kept]))
    busy_s = float(np.median([c for _, c in kept]))
    log.info("rank %d stage %d/%d timing: median update %.4f s, engine calls %.4f s, idle %.2f over %d updates",
             rt.comm.rank, rt.stage, rt.num_stages, step_s, busy_s, 1 - busy_s / step_s if step_s > 0 else 0.0,
             len(kept))
    return step_s, busy_s
