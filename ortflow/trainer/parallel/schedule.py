"""The pipeline schedule (1F1B with activation recomputation) and the training loop of a pipeline rank.

Micro-batches are ``train.gradient_accumulation_steps``. Stage ``s`` of ``P`` runs ``min(P - s - 1, m)`` forward
passes (warm-up), then alternates one forward and one backward, then drains the remaining backwards (1F1B, as in
PipeDream-Flush / Megatron). A forward runs the stage's eval model (nothing kept); the backward call recomputes the
forward, so a stage holds one micro-batch's activations at a time and, between its forward and backward passes,
only the tensors it received (at most ``P - s`` micro-batches of them). GPipe would hold all ``m`` received inputs
and gains nothing here: with recomputation both schedules compute the same and 1F1B keeps less.

Sends are non-blocking (MPI ``Isend``) and receives block under the watchdog in schedule order, so no pair of
stages waits on each other; the label of a stalled receive names the stage and rank it waits for.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnxruntime

from ortflow.checkpoints import CheckpointManager
from ortflow.trainer.guards import check_update, clip_gradients
from ortflow.trainer.lr_schedule import learning_rate
from ortflow.trainer.metrics import Progress, TensorBoardLog
from ortflow.trainer.parallel.bookkeeping import checkpoint_meta, report_window
from ortflow.trainer.parallel.pipeline_stage import ACT_TAG as _ACT
from ortflow.trainer.parallel.pipeline_stage import GRAD_TAG as _GRAD
from ortflow.trainer.parallel.pipeline_stage import TIED_TAG as _TIED
from ortflow.trainer.parallel.pipeline_stage import StageRuntime

log = logging.getLogger("ortflow.trainer")


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
            pass: the sends not yet known to be received (MPI; 0 where the communicator does not say).
        compute_s: Seconds inside the engine's forward/backward calls (the rest of the step is waiting/transfer).
    """

    loss_sum: float = 0.0
    most_held: int = 0
    held_bytes: int = 0
    sent_bytes: int = 0
    compute_s: float = 0.0


def pipeline_step(rt: StageRuntime, batches: Iterator[dict[str, np.ndarray]], k: int,
                  clock: Callable[[], float] = time.perf_counter) -> StepStats:
    """Forward and backward passes of ``k`` micro-batches through the pipeline; gradients accumulate in the engine."""
    pipe, stage = rt.pipe_comm, rt.stage
    micro = [next(batches) for _ in range(k)]
    held: dict[int, dict[str, np.ndarray]] = {}
    stats = StepStats()
    for kind, i in one_f_one_b(stage, rt.num_stages, k):
        if i not in held:  # receive (or, on stage 0, take from the batch) this micro-batch's inputs
            feeds = dict(micro[i])
            for name in rt.receives:
                feeds[name] = pipe.recv(stage - 1, _ACT, f"recv act mb{i} <- stage {stage - 1}")
            held[i] = feeds
            if len(held) > stats.most_held:
                stats.most_held = len(held)
                stats.held_bytes = sum(f[n].nbytes for f in held.values() for n in rt.receives)
        started = clock()
        if kind == "F":
            outputs = rt.forward(held[i])
            stats.compute_s += clock() - started
            for y in outputs:
                pipe.send(y, stage + 1, _ACT)
            stats.sent_bytes = max(stats.sent_bytes, _pending_send_bytes(pipe))
            continue
        grads = None
        if not rt.last:
            grads = [pipe.recv(stage + 1, _GRAD, f"recv grad mb{i} <- stage {stage + 1}") for _ in rt.sends]
            started = clock()
        loss, back = rt.backward(held.pop(i), grads)
        stats.compute_s += clock() - started
        if rt.last:
            stats.loss_sum += loss
        for g in back:
            pipe.send(g, stage - 1, _GRAD)
        stats.sent_bytes = max(stats.sent_bytes, _pending_send_bytes(pipe))
    # Sync point: the sent tensors' buffers must outlive their sends; a stalled peer shows here.
    pipe.wait_sends(f"pipeline sends of stage {stage}")
    return stats


def _pending_send_bytes(pipe) -> int:
    pending = getattr(pipe, "pending_send_bytes", None)
    return pending() if pending is not None else 0


def sum_tied_gradients(rt: StageRuntime) -> None:
    """Every holder of a tied parameter ends with the sum of all holders' gradients, added in stage order on each, so
    the sums (and then the copies after the update) are bitwise equal on every holder."""
    if not rt.shared:
        return
    pipe, parts = rt.pipe_comm, {}
    for name, holders in sorted(rt.shared.items()):
        mine = np.array(rt.state.parameters[name].grad, copy=True)
        parts[name] = {rt.stage: mine}
        for other in holders:
            if other != rt.stage:
                pipe.send(mine, other, _TIED)
    for name, holders in sorted(rt.shared.items()):
        for other in holders:
            if other != rt.stage:
                parts[name][other] = pipe.recv(other, _TIED, f"recv tied grad {name[:20]} <- stage {other}")
        total = parts[name][holders[0]].copy()
        for other in holders[1:]:
            total += parts[name][other]
        rt.state.parameters[name].grad[...] = total
    # Sync point: the sent copies must outlive their sends.
    pipe.wait_sends("tied gradient sends")


def evaluate_pipeline(rt: StageRuntime, eval_batches: Callable[[], Iterator[tuple[dict, float, int]]]) -> float | None:
    """Mean eval loss: each replica's stages pass its eval batches forward; the last stage computes the loss.

    ``eval_batches`` yields ``(feeds, weight, rows)`` as for the unsplit loop (padded batches weighted so that every
    real row counts once).
    """
    pipe, stage = rt.pipe_comm, rt.stage
    sums = np.zeros(2)
    for n, (batch, weight, rows) in enumerate(eval_batches()):
        feeds = dict(batch)
        for name in rt.receives:
            feeds[name] = pipe.recv(stage - 1, _ACT, f"recv eval act {n} <- stage {stage - 1}")
        if rt.last:
            loss = rt.eval_loss(feeds)
            if getattr(rt, "counts_loss", True):  # of a pp x hp last stage's tp ranks (same loss), one counts
                sums += (loss * weight, rows)
        else:
            for y in rt.forward(feeds):
                pipe.send(y, stage + 1, _ACT)
        pipe.wait_sends("pipeline eval sends")
    rt.module.train()
    # Sync point: only last stages hold losses; every rank needs the mean.
    total = rt.comm.allreduce_sum(sums, "eval loss")
    return float(total[0] / total[1]) if total[1] else None


def stage_digests(rt: StageRuntime, step: int) -> list[str]:
    """Each stage's parameter sha256; raises if a stage's replicas differ (they must be bitwise identical)."""
    digest = hashlib.sha256()
    for name in rt.trainable:
        digest.update(np.ascontiguousarray(rt.state.parameters[name].data))
    mine = digest.hexdigest()
    # Sync point: the replicas of a stage must hold identical parameters; a silent divergence would poison checkpoints.
    reference = rt.stage_comm.broadcast(mine, "stage parameter digest")
    mismatches = rt.comm.allreduce_sum(np.array([float(mine != reference)]), "parameter digest check")[0]
    log.info("rank %d parameters sha256 %s at step %d", rt.comm.rank, mine, step)
    if mismatches:
        raise RuntimeError(f"stage replicas diverged at step {step}: {int(mismatches)} rank(s) differ")
    return rt.pipe_comm.gather_object(mine, "gather stage digests") if rt.replica == 0 else None


def train_pipeline(
    rt: StageRuntime,
    train_batches: Callable[[int], Iterator[dict[str, np.ndarray]]],
    eval_batches: Callable[[], Iterator[tuple[dict, float, int]]],
    checkpoints: CheckpointManager,
    tensorboard: TensorBoardLog | None,
    progress: Progress | None,
    stop,
    tokens_per_sample: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
):
    """The loop of :func:`ortflow.trainer.loop.train` for a pipeline rank (same arguments, same result)."""
    from ortflow.trainer.loop import TrainResult

    cfg = rt.cfg
    k, replicas, batch = cfg.train.gradient_accumulation_steps, rt.num_replicas, cfg.train.batch_size
    total, period = cfg.train.num_weight_updates, cfg.train.evaluation_period
    step = rt.resume.step if rt.resume else 0
    cursor = rt.resume.global_cursor if rt.resume else 0
    batches = train_batches(cursor)
    grads = rt.gradient_buffers()  # host views on the CPU, device buffers on CUDA
    scalars = np.zeros(3)  # [loss sum (last stages), stop requested, squared gradient norm (replica 0 of each stage)]
    train_loss = eval_loss = None
    window_start, window_samples = clock(), 0
    timing: list[tuple[float, float]] = []  # (step seconds, seconds inside engine calls) of each update
    while step < total and not scalars[1]:
        lr = learning_rate(step, total, cfg.optimizer.learning_rate, cfg.lr_schedule)
        onnxruntime.set_seed(cfg.train.seed + step)
        step_started = clock()
        stats = pipeline_step(rt, batches, k)
        loss_sum = stats.loss_sum
        # Sync point: a stage's replicas average their gradients (the unsplit loop's all-reduce, per stage).
        mine = rt.exchange.reduce(grads, k * replicas, np.zeros(0, np.float32))
        sum_tied_gradients(rt)  # Sync point: holders of a tied weight add their gradients (point-to-point)
        own = [g for n, g in zip(rt.trainable, mine, strict=True) if n not in rt.shared or rt.shared[n][0] == rt.stage]
        norm_sq = rt.exchange.norm(own) ** 2 if rt.replica == 0 else 0.0  # a tied weight counted once
        local = np.array([loss_sum / k, float(stop.requested), norm_sq])
        # Sync point: loss, stop flag and gradient norm agree on every rank of every stage.
        scalars = rt.comm.allreduce_sum(local, "pipeline loss, stop, norm")
        train_loss, grad_norm = float(scalars[0]) / replicas, float(np.sqrt(scalars[2]))
        check_update(step + 1, train_loss, grad_norm)  # the same values on every rank: all stop alike if non-finite
        clip_gradients(rt.exchange, mine, grad_norm, cfg.optimizer.max_grad_norm)
        rt.update.step(mine, lr)  # ortflow's rule, in place on this stage's parameter buffers
        rt.module.lazy_reset_grad()
        timing.append((clock() - step_started, stats.compute_s))
        step += 1
        cursor += k * replicas * batch
        window_samples += k * replicas * batch
        evaluated = period > 0 and step % period == 0 or step == total
        paused = clock()
        eval_loss = evaluate_pipeline(rt, eval_batches) if evaluated else None
        window_start += clock() - paused
        if progress is not None and (step % cfg.train.display_loss_steps == 0 or evaluated):
            report_window(progress, tensorboard, step, total, clock() - window_start, window_samples, tokens_per_sample,
                          {"loss": train_loss, "eval_loss": eval_loss, "lr": lr, "grad_norm": grad_norm})
            window_start, window_samples = clock(), 0
        if checkpoints.should_save(step, final=step == total or bool(scalars[1])):
            paused = clock()
            _save(rt, checkpoints, step, checkpoint_meta(cfg, rt.comm.size, cursor, train_loss, eval_loss,
                                                         pipeline_parallel_size=rt.num_stages))
            window_start += clock() - paused
    log_stage_timing(rt, timing)
    if scalars[1]:
        log.warning("stop requested: ranks stopped together after step %d (checkpoint saved)", step)
    return TrainResult(step, cursor, train_loss, eval_loss, stopped=bool(scalars[1]))


def log_stage_timing(rt: StageRuntime, timing: list[tuple[float, float]]) -> tuple[float, float] | None:
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


def _save(rt: StageRuntime, checkpoints: CheckpointManager, step: int, meta: dict) -> None:
    """Every stage's first replica writes its stage's HDF5 files into the one checkpoint folder (complete or absent:
    rank 0 checksums them all and writes meta.json last)."""
    digests = stage_digests(rt, step)
    # Every rank takes part (the manager's barriers); replicas other than each stage's first write nothing.
    checkpoints.save(step, rt.train_state(), {**meta, "params_sha256": digests})
