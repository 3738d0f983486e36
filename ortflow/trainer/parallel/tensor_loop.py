"""The training loop of a tensor-parallel rank (:func:`ortflow.trainer.loop.train`'s arguments and result)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import onnxruntime

from ortflow.checkpoints import CheckpointManager
from ortflow.trainer.guards import check_update, clip_gradients
from ortflow.trainer.lr_schedule import learning_rate
from ortflow.trainer.metrics import Progress, TensorBoardLog
from ortflow.trainer.parallel.bookkeeping import checkpoint_meta, report_window
from ortflow.trainer.parallel.tensor_piece import TensorRuntime

log = logging.getLogger("ortflow.trainer")


def evaluate_tensor(rt: TensorRuntime, eval_batches: Callable[[], Iterator[tuple[dict, float, int]]]) -> float | None:
    """Mean eval loss over the replicas' eval batches (every tp rank computes the same loss; rank 0's counts)."""
    sums = np.zeros(2)
    for batch, weight, rows in eval_batches():
        sums += (rt.eval_loss(batch) * weight, rows)
    for piece in rt.pieces:
        piece.module.train()
    mine = sums if rt.tp_rank == 0 else np.zeros(2)
    # Sync point: every rank needs the mean over the replicas.
    total = rt.comm.allgather_sum(mine, "eval loss")
    return float(total[0] / total[1]) if total[1] else None


def check_replicas(rt: TensorRuntime, step: int) -> None:
    """Replicated parameters are bitwise equal on the tp ranks, and each rank's slices on its replicas; else raise."""
    replicated = sorted(n for n in rt.holders if n not in rt.slicing)
    mine = rt.digest(replicated)
    # Sync points: a silent divergence would poison the checkpoints.
    same_tp = rt.tp_comm.broadcast(mine, "replicated parameter digest") == mine
    whole = rt.digest(sorted(rt.holders))
    same_dp = rt.dp_comm.broadcast(whole, "tensor-parallel replica digest") == whole
    bad = rt.comm.allreduce_sum(np.array([float(not same_tp), float(not same_dp)]), "digest check")
    log.info("rank %d parameters sha256 %s (replicated %s) at step %d", rt.comm.rank, whole, mine, step)
    if bad.any():
        raise RuntimeError(f"tensor-parallel ranks diverged at step {step}: {int(bad[0])} rank(s) hold other "
                           f"replicated parameters, {int(bad[1])} other slices than their replica 0")


def train_tensor(rt: TensorRuntime, train_batches, eval_batches, checkpoints: CheckpointManager,
                 tensorboard: TensorBoardLog | None, progress: Progress | None, stop,
                 tokens_per_sample: int | None = None, clock: Callable[[], float] = time.perf_counter):
    """The loop of :func:`ortflow.trainer.loop.train` for a tensor-parallel rank (same arguments, same result)."""
    from ortflow.trainer.loop import TrainResult

    cfg = rt.cfg
    k, replicas, batch = cfg.train.gradient_accumulation_steps, rt.num_replicas, cfg.train.batch_size
    total, period = cfg.train.num_weight_updates, cfg.train.evaluation_period
    step = rt.resume.step if rt.resume else 0
    cursor = rt.resume.global_cursor if rt.resume else 0
    batches = train_batches(cursor)
    grads = rt.gradient_buffers()
    scalars = np.zeros(3)  # [loss sum (tp rank 0), stop requested, squared gradient norm]
    train_loss = eval_loss = None
    window_start, window_samples = clock(), 0
    while step < total and not scalars[1]:
        lr = learning_rate(step, total, cfg.optimizer.learning_rate, cfg.lr_schedule)
        onnxruntime.set_seed(cfg.train.seed + step)
        loss_sum = rt.accumulate(batches, k)  # one after another, or through the pipeline stages (pp x hp)
        rt.sum_tied_gradients()
        # Sync point: each tp rank's replicas average their gradients (the unsplit loop's all-reduce, per tp rank).
        mine = rt.exchange.reduce(grads, k * replicas, np.zeros(0, np.float32))
        norm_sq = rt.norm_sq(mine) if rt.replica == 0 else 0.0  # the replicated gradients counted once
        local = np.array([loss_sum / k if rt.tp_rank == 0 else 0.0, float(stop.requested), norm_sq])
        # Sync point: loss, stop flag and gradient norm, added in rank order: bitwise the same on every rank.
        scalars = rt.comm.allgather_sum(local, "tensor-parallel loss, stop, norm")
        train_loss, grad_norm = float(scalars[0]) / replicas, float(np.sqrt(scalars[2]))
        check_update(step + 1, train_loss, grad_norm)
        clip_gradients(rt.exchange, mine, grad_norm, cfg.optimizer.max_grad_norm)
        rt.update.step(mine, lr)  # ortflow's rule, in place on this rank's slices and replicated parameters
        rt.copy_tied_parameters()
        rt.reset_gradients()
        step += 1
        cursor += k * replicas * batch
        window_samples += k * replicas * batch
        evaluated = period > 0 and step % period == 0 or step == total
        paused = clock()
        if evaluated and step == total:  # saved first: a failing final evaluation never costs the trained weights
            _save(rt, checkpoints, step, checkpoint_meta(cfg, rt.comm.size, cursor, train_loss, None,
                                                         horizontal_parallel_size=rt.tp_size,
                                                         pipeline_parallel_size=rt.pipe[1] if rt.pipe else 1))
        if evaluated:
            eval_loss = rt.evaluate(eval_batches) if rt.pipe else evaluate_tensor(rt, eval_batches)
        else:
            eval_loss = None
        window_start += clock() - paused
        if progress is not None and (step % cfg.train.display_loss_steps == 0 or evaluated):
            report_window(progress, tensorboard, step, total, clock() - window_start, window_samples, tokens_per_sample,
                          {"loss": train_loss, "eval_loss": eval_loss, "lr": lr, "grad_norm": grad_norm})
            window_start, window_samples = clock(), 0
        # (the final step was saved before its evaluation: saved again, with its eval loss)
        if checkpoints.should_save(step, final=step == total or bool(scalars[1])) or evaluated and step == total:
            paused = clock()
            _save(rt, checkpoints, step, checkpoint_meta(cfg, rt.comm.size, cursor, train_loss, eval_loss,
                                                         horizontal_parallel_size=rt.tp_size,
                                                         pipeline_parallel_size=rt.pipe[1] if rt.pipe else 1))
            window_start += clock() - paused
    if scalars[1]:
        log.warning("stop requested: ranks stopped together after step %d (checkpoint saved)", step)
    return TrainResult(step, cursor, train_loss, eval_loss, stopped=bool(scalars[1]))


def _save(rt: TensorRuntime, checkpoints, step: int, meta: dict) -> None:
    """Check that the replicas agree, then save the checkpoint of ``step`` (every rank takes part)."""
    check_replicas(rt, step)
    checkpoints.save(step, rt.train_state(), meta)
