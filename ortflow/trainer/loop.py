"""The training loop: one function, top to bottom (TrainingRunner::Run)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnxruntime

from ortflow.checkpoints import CheckpointManager
from ortflow.trainer import loss_scale
from ortflow.trainer.guards import check_update, clip_gradients
from ortflow.trainer.lr_schedule import learning_rate
from ortflow.trainer.metrics import Progress, TensorBoardLog
from ortflow.trainer.profiling import StepProfiler
from ortflow.trainer.runtime import Runtime
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")


@dataclass
class StopFlag:
    """Set by a signal handler; honoured by every rank at the same weight update."""

    requested: bool = False
    signum: int = 0  # the signal this rank received (0: none; it stops because another rank did)


@dataclass(frozen=True)
class TrainResult:
    """How a rank's loop ended."""

    step: int
    global_cursor: int
    train_loss: float | None
    eval_loss: float | None
    stopped: bool


def evaluate(rt: Runtime, eval_batches: Callable[[], Iterator[tuple[dict, float, int]]]) -> float | None:
    """Mean eval loss over the whole eval split, each rank taking its share; None if the split is empty.

    ``eval_batches`` yields ``(feeds, weight, rows)`` (``EvalLoader.weighted_batches``): padded batches of a model
    with a fixed batch dim are weighted so that every real row counts exactly once.
    """
    rt.module.eval()
    names = rt.module.input_names()
    sums = np.zeros(2)
    for feeds, weight, rows in eval_batches():  # the eval model takes no loss scale (configure fixed it to 1)
        sums += (float(rt.module(*(feeds[n] for n in names))) * weight, rows)
    rt.module.train()
    # Sync point: the eval split is sharded over ranks, so the mean needs every rank's loss sum and row count.
    total = rt.comm.allreduce_sum(sums, "eval loss")
    if rt.comm.rank == 0:
        log.info("eval loss %.6g over %d rows", total[0] / total[1] if total[1] else float("nan"), int(total[1]))
    return float(total[0] / total[1]) if total[1] else None


def check_ranks_identical(rt: Runtime, step: int) -> str:
    """sha256 of this rank's trainable parameters; raises if any rank's differs from rank 0's (ranks diverged)."""
    digest = hashlib.sha256()
    for name in rt.trainable:
        digest.update(np.ascontiguousarray(rt.state.parameters[name].data))  # no copy: the views are contiguous
    mine = digest.hexdigest()
    # Sync point: data-parallel replicas must hold identical parameters; a silent divergence would poison checkpoints.
    reference = rt.comm.broadcast(mine, "parameter digest")
    mismatches = rt.comm.allreduce_sum(np.array([float(mine != reference)]), "parameter digest check")[0]
    log.info("rank %d parameters sha256 %s at step %d", rt.comm.rank, mine, step)
    if mismatches:
        raise RuntimeError(f"ranks diverged at step {step}: {int(mismatches)} rank(s) differ from rank 0's parameters")
    return mine


def train(
    rt: Runtime,
    train_batches: Callable[[int], Iterator[dict[str, np.ndarray]]],
    eval_batches: Callable[[], Iterator[tuple[dict, float, int]]],
    checkpoints: CheckpointManager,
    tensorboard: TensorBoardLog | None,
    progress: Progress | None,
    stop: StopFlag,
    tokens_per_sample: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainResult:
    """Run weight updates from the resume point to ``num_weight_updates``.

    Args:
        rt: The started rank (session, update, exchange, communicator, config).
        train_batches: ``cursor -> iterator`` of this rank's micro-batches from a global sample cursor.
        eval_batches: Iterator factory over this rank's share of the eval split, yielding (feeds, weight, rows).
        checkpoints: Owns when to save and what to keep; the loop only offers each step.
        tensorboard: Rank 0's event writer (None on other ranks).
        progress: Rank 0's progress reporter (None on other ranks).
        stop: Stop request from a signal; all ranks agree on it through the update's all-reduce.
        tokens_per_sample: For tokens/s (text data), else None.
        clock: Time source for throughput.
    """
    if rt.cfg.distributed.horizontal_parallel_size > 1:  # split layers: pieces with all-reduces between them
        from ortflow.trainer.parallel.tensor_loop import train_tensor

        return train_tensor(rt, train_batches, eval_batches, checkpoints, tensorboard, progress, stop,
                            tokens_per_sample, clock)
    if rt.cfg.distributed.pipeline_parallel_size > 1:  # stages exchange activations: the pipeline's own schedule
        from ortflow.trainer.parallel.schedule import train_pipeline

        return train_pipeline(rt, train_batches, eval_batches, checkpoints, tensorboard, progress, stop,
                              tokens_per_sample, clock)
    cfg, comm, module, update, exchange, scaler = rt.cfg, rt.comm, rt.module, rt.update, rt.exchange, rt.loss_scale
    k, world, batch = cfg.train.gradient_accumulation_steps, comm.size, cfg.train.batch_size
    total, period = cfg.train.num_weight_updates, cfg.train.evaluation_period
    step = rt.resume.step if rt.resume else 0
    cursor = rt.resume.global_cursor if rt.resume else 0
    names = module.input_names()
    batches = train_batches(cursor)
    grads: list = []
    scalars = np.zeros(2, dtype=np.float32)  # [this rank's mean loss, stop requested]
    train_loss = eval_loss = None
    window_samples = 0
    fingerprint = cfg.section_fingerprint()
    timer, profiler = PhaseTimer(clock), StepProfiler.for_run(rt)  # step-time breakdown; per-op profile on demand

    while step < total and not scalars[1]:
        lr = learning_rate(step, total, cfg.optimizer.learning_rate, cfg.lr_schedule)
        onnxruntime.set_seed(cfg.train.seed + step)  # randomness in the graph replays exactly after a resume

        loss_sum, engine = 0.0, profiler.module_for(step + 1)
        timer.lap("other")  # reporting of the previous update, learning rate, seed
        for _ in range(k):  # the engine sums the micro-batches' gradients
            feeds = scaler.feed(next(batches))  # fp16: the graph multiplies the loss by the scale input
            timer.lap("data")
            loss_sum += float(engine(*(feeds[n] for n in names)))
            timer.lap("forward_backward")
        if not grads:  # the engine's own buffers (host views, device buffers on CUDA), fixed for the module's life
            grads = rt.gradient_buffers()
        profiler.after_backward(step + 1)
        scalars[:] = (loss_sum / k / scaler.scale, float(stop.requested))
        # Sync point: mean gradient over k micro-batches x ranks, plus loss and stop (ZeRO-1: this rank's share); the
        # loss scale is divided out here too.
        mine = exchange.reduce(grads, k * world * scaler.scale, scalars)
        timer.lap_exchange()
        step += 1
        cursor += k * world * batch
        window_samples += k * world * batch
        train_loss = float(scalars[0]) / world
        evaluated = period > 0 and step % period == 0 or step == total
        report = progress is not None and (step % cfg.train.display_loss_steps == 0 or evaluated)
        # The norm is one pass over the gradients, computed every update: it guards the parameters against NaN/inf.
        # Every rank gets the same norm (ZeRO-1: summed from the shards in rank order), so every rank clips alike and
        # decides alike (the engine's own clipping operator is not deterministic, so clipping is done here).
        grad_norm = exchange.norm(mine)
        # fp16 loss scaling overflows on purpose now and then: that update is skipped on every rank (scale halved);
        # any other non-finite loss or norm stops the job before it reaches the parameters or a checkpoint.
        stepped = scaler.update(grad_norm) and check_update(step, train_loss, grad_norm, skip_overflow=scaler.enabled)
        if stepped:
            clip_gradients(exchange, mine, grad_norm, cfg.optimizer.max_grad_norm)
        timer.lap("norm_clip")
        if stepped:
            update.step(mine, lr)  # ortflow's rule, in place on the engine's parameter buffers
        exchange.gather()  # Sync point (ZeRO-1): every rank's updated shard back into every rank's parameters
        module.lazy_reset_grad()
        timer.lap("update")

        eval_loss = evaluate(rt, eval_batches) if evaluated else None
        timer.lap("eval")
        if report:
            elapsed = timer.training_seconds()  # throughput counts training time only
            samples_per_s = window_samples / elapsed if elapsed > 0 else None
            tokens_per_s = samples_per_s * tokens_per_sample if samples_per_s and tokens_per_sample else None
            fields = {
                "loss": train_loss, "eval_loss": eval_loss, "lr": lr, "grad_norm": grad_norm,
                "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s, "time": timer.describe(),
                **scaler.report(),
            }
            progress.report(step, fields, final=step == total)
            if tensorboard is not None:
                tensorboard.scalars(step, {
                    "train/loss": train_loss, "eval/loss": eval_loss, "train/learning_rate": lr,
                    "train/grad_norm": grad_norm, "train/samples_per_s": samples_per_s,
                    "train/tokens_per_s": tokens_per_s, **timer.scalars(),
                    **{f"train/{name}": value for name, value in scaler.report().items()},
                })
                tensorboard.histograms(step, {n: rt.state.parameters[n].data for n in rt.trainable})
                tensorboard.flush()
            window_samples = 0
            timer.new_window()
        timer.lap("other")

        if checkpoints.should_save(step, final=step == total or bool(scalars[1])):
            meta = {
                "global_cursor": cursor, "num_train_steps": cfg.train.num_train_steps, "num_weight_updates": total,
                "train_loss": train_loss, "eval_loss": eval_loss, "num_ranks": world, "config_fingerprint": fingerprint,
                "rng": {"seed": cfg.train.seed, "scheme": "onnxruntime.set_seed(seed + step) before each update"},
                "params_sha256": check_ranks_identical(rt, step),
                loss_scale.META_KEY: loss_scale.checkpoint_state(scaler),
            }
            checkpoints.save(step, rt.train_state(), meta)
        timer.lap("checkpoint")

    profiler.close()
    if progress is not None:
        timer.write_summary(rt.run_dir)  # the whole run's breakdown, for the run summary
    if scalars[1]:
        log.warning("stop requested: ranks stopped together after step %d (checkpoint saved)", step)
    return TrainResult(step, cursor, train_loss, eval_loss, stopped=bool(scalars[1]))
