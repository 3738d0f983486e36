"""The training loop: one function, top to bottom, for every layout (the rank's model says what differs).

LR and seed -> micro-batches -> exchange -> guard and clip -> update -> hooks: eval, report, checkpoint (the per-op
profiler brackets the micro-batches of the updates it traces). Hooks are plain functions called in that order.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ortflow import engine
from ortflow.checkpoints import CheckpointManager
from ortflow.checkpoints.folder import MICRO_BATCHES_KEY
from ortflow.trainer import batchnorm, loss_scale
from ortflow.trainer.guards import check_update, clip_gradients
from ortflow.trainer.lr_schedule import learning_rate
from ortflow.trainer.metrics import Progress, TensorBoardLog
from ortflow.trainer.outcome import StopFlag, TrainResult
from ortflow.trainer.profiling import StepProfiler
from ortflow.trainer.rank_model import EvalBatches, RankModel
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")

__all__ = ["StopFlag", "TrainResult", "Updated", "evaluate", "train", "update_weights"]

#: How a resumed run replays the graph's randomness (recorded in every checkpoint's meta).
RNG_SCHEME = "onnxruntime.set_seed(seed + step) before each update"


def train(
    model: RankModel,
    train_batches: Callable[[int], Iterator[dict[str, np.ndarray]]],
    eval_batches: EvalBatches,
    checkpoints: CheckpointManager,
    tensorboard: TensorBoardLog | None,
    progress: Progress | None,
    stop: StopFlag,
    tokens_per_sample: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainResult:
    """Run weight updates from the resume point to ``num_weight_updates``.

    Args:
        model: This rank's model (a replica, a pipeline stage, tensor-parallel pieces; :mod:`.rank_model`).
        train_batches: ``cursor -> iterator`` of this rank's micro-batches from a global sample cursor.
        eval_batches: This rank's share of the eval split (``EvalLoader``).
        checkpoints: Owns when to save and what to keep; the loop only offers each step.
        tensorboard: Rank 0's event writer (None on other ranks).
        progress: Rank 0's progress reporter (None on other ranks).
        stop: Stop request from a signal; all ranks agree on it through the exchange.
        tokens_per_sample: For tokens/s (text data), else None.
        clock: Time source for the step-time breakdown and throughput.
    """
    cfg = model.cfg
    k, total, period = cfg.train.gradient_accumulation_steps, cfg.train.num_weight_updates, cfg.train.evaluation_period
    samples = k * model.dims.dp * cfg.train.batch_size  # one update's samples, over the replicas
    step = model.resume.step if model.resume else 0
    cursor = model.resume.global_cursor if model.resume else 0
    if model.resume and model.comm.rank == 0:
        note_batch_change(model.resume.meta, model.resume.path.name, samples, model.dims.dp, k, cfg.train)
    batches = train_batches(cursor)
    timer, profiler = PhaseTimer(clock), StepProfiler.for_run(model)  # step-time breakdown; per-op profile on demand
    window = Window(model, progress, tensorboard, timer, tokens_per_sample)
    norm_stats = batchnorm.for_model(model)  # BatchNormalization running statistics: torch's rule, one per run
    train_loss = eval_loss = None
    stopping = False

    while step < total and not stopping:
        lr = learning_rate(step, total, cfg.optimizer.learning_rate, cfg.lr_schedule)
        engine.set_seed(cfg.train.seed + step)  # randomness in the graph replays exactly after a resume
        timer.lap("other")  # reporting of the previous update, learning rate, seed

        updated = update_weights(model, batches, step + 1, lr, stop.requested, timer, profiler, norm_stats)
        step, cursor, train_loss, stopping = step + 1, cursor + samples, updated.loss, updated.stop
        window.samples += samples

        # Hooks: eval, report, checkpoint.
        final = step == total
        evaluated = period > 0 and step % period == 0 or final
        if evaluated or checkpoints.should_save(step, final=final or stopping):
            norm_stats.sync()  # Sync point: every replica evaluates and saves the same running statistics
        if evaluated and final:  # saved first: a failing final evaluation never costs the trained weights
            save(model, checkpoints, step, cursor, train_loss, None)
            # Sync point: no rank evaluates (and may fail, aborting the job) before rank 0 has the checkpoint in place;
            # without it a data-parallel rank, which does not wait for rank 0's write, could abort it mid-write.
            model.comm.barrier("final checkpoint saved")
        eval_loss = evaluate(model, eval_batches) if evaluated else None
        timer.lap("eval")
        if step % cfg.train.display_loss_steps == 0 or evaluated:
            window.report(step, final, {"loss": train_loss, "eval_loss": eval_loss, "lr": lr,
                                         "grad_norm": updated.grad_norm})
        timer.lap("other")
        if evaluated and final:  # saved before its evaluation: its meta.json records the eval loss now
            if eval_loss is not None:
                checkpoints.amend(step, {"eval_loss": eval_loss})
        elif checkpoints.should_save(step, final=final or stopping):
            save(model, checkpoints, step, cursor, train_loss, eval_loss)
        timer.lap("checkpoint")

    profiler.close()
    model.finish()
    if progress is not None:
        timer.write_summary(model.run_dir)  # the whole run's breakdown, for the run summary
    if stopping:
        log.warning("stop requested: ranks stopped together after step %d (checkpoint saved)", step)
    return TrainResult(step, cursor, train_loss, eval_loss, stopped=stopping)


@dataclass(frozen=True)
class Updated:
    """What one weight update leaves the hooks, equal on every rank."""

    loss: float  #: the mean training loss over the micro-batches and replicas
    grad_norm: float  #: the global gradient norm before clipping
    stop: bool  #: whether any rank asked to stop


def update_weights(model: RankModel, batches: Iterator[dict[str, np.ndarray]], step: int, lr: float, stop: bool,
                   timer: PhaseTimer, profiler: StepProfiler, norm_stats: batchnorm.RunningStats) -> Updated:
    """Weight update ``step`` (1-based): micro-batches -> exchange -> guard and clip -> update, on any layout.

    The one path every weight update takes: the training loop's and ``ortflow tune``'s
    (:mod:`ortflow.trainer.tune_updates`).
    """
    cfg, scaler = model.cfg, model.loss_scale
    k = cfg.train.gradient_accumulation_steps
    profiler.begin(step)
    loss_sum = model.accumulate(batches, k, timer)  # the engine sums the micro-batches' gradients
    norm_stats.after_update()  # the engine's biased running variance -> torch's unbiased one
    profiler.after_backward(step)
    # Sync point: the mean gradient over k micro-batches x replicas, with the loss and the stop flag (and a split
    # model's norm shares); every rank gets the same loss, stop flag and norm.
    reduced = model.reduce(k, loss_sum, stop)
    timer.lap_exchange()

    # The norm is computed every update: it guards the parameters against NaN/inf. Every rank gets the same norm,
    # so every rank clips alike and decides alike (the engine's own clipping is not deterministic: done here).
    grad_norm = model.grad_norm(reduced)
    # fp16 loss scaling overflows on purpose now and then: that update is skipped on every rank (scale halved);
    # any other non-finite loss or norm stops the job before it reaches the parameters or a checkpoint.
    stepped = scaler.update(grad_norm) and check_update(step, reduced.loss, grad_norm, skip_overflow=scaler.enabled)
    if stepped:
        clip_gradients(model.exchange, reduced.grads, grad_norm, cfg.optimizer.max_grad_norm)
    timer.lap("norm_clip")
    if stepped:
        model.update.step(reduced.grads, lr)  # ortflow's rule, in place on the engine's parameter buffers
    model.after_update()  # Sync point (ZeRO-1): every updated shard back to every rank; tied copies; grads reset
    timer.lap("update")
    return Updated(reduced.loss, grad_norm, reduced.stop)


def evaluate(model: RankModel, eval_batches: EvalBatches) -> float | None:
    """Mean eval loss over the whole eval split, each replica taking its share; None if the split is empty.

    ``eval_batches`` is this rank's ``EvalLoader``: padded batches of a model with a fixed batch dim are weighted so
    that every real row counts exactly once. The batches and the rule that adds them (:func:`mean_eval_loss`) are
    those of ``ortflow evaluate``, so both give one number for one checkpoint.
    """
    from ortflow.dataprep.loader import mean_eval_loss  # the rank entry imports the loader only when it runs

    sums = model.eval_sums(eval_batches)
    # Sync point: the eval split is sharded over the replicas, so the mean needs every batch's loss sum and row count
    # (each batch's entry is one rank's value plus zeros: exact, whatever the order of the sum over ranks).
    total = model.sum_scalars(sums.ravel(), "eval loss").reshape(sums.shape)
    loss = mean_eval_loss(total)
    if model.comm.rank == 0:
        log.info("eval loss %.6g over %d rows", float("nan") if loss is None else loss, int(total[:, 1].sum()))
    return loss


class Window:
    """The report hook: rank 0's progress line and TensorBoard events for the updates since the last report."""

    def __init__(self, model: RankModel, progress: Progress | None, tensorboard: TensorBoardLog | None,
                 timer: PhaseTimer, tokens_per_sample: int | None):
        self.model, self.progress, self.tensorboard, self.timer = model, progress, tensorboard, timer
        self.tokens_per_sample, self.samples = tokens_per_sample, 0
        self.patterns = tuple(model.cfg.tensorboard.histogram_names)

    def report(self, step: int, final: bool, fields: dict) -> None:
        """Called on every rank (a split model gathers its parameters for the histograms); rank 0 writes."""
        # Sync point (a split model): rank 0 gathers the stages and merges the slices the histograms show.
        params = self.model.whole_parameters(self._wanted) if self.patterns else None
        if self.progress is None:
            return
        elapsed = self.timer.training_seconds()  # throughput counts training time only
        samples_per_s = self.samples / elapsed if elapsed > 0 else None
        tokens_per_s = samples_per_s * self.tokens_per_sample if samples_per_s and self.tokens_per_sample else None
        scaler = self.model.loss_scale.report()
        self.progress.report(step, {**fields, "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s,
                                    "time": self.timer.describe(), **scaler}, final=final)
        if self.tensorboard is not None:
            self.tensorboard.scalars(step, {
                "train/loss": fields["loss"], "eval/loss": fields["eval_loss"], "train/learning_rate": fields["lr"],
                "train/grad_norm": fields["grad_norm"], "train/samples_per_s": samples_per_s,
                "train/tokens_per_s": tokens_per_s, **self.timer.scalars(),
                **{f"train/{name}": value for name, value in scaler.items()},
            })
            self.tensorboard.histograms(step, params or {})
            self.tensorboard.flush()
        self.samples = 0
        self.timer.new_window()

    def _wanted(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


#: The key of meta.json that records one weight update's samples over the replicas.
SAMPLES_KEY = "samples_per_update"


def note_batch_change(meta: dict, name: str, samples: int, replicas: int, micro_batches: int, train) -> None:
    """Warn when a resumed run takes another number of samples per update than the checkpoint's run (a layout
    changed under a per-rank ``train.batch_size``, or an accepted edit of the batch): allowed, but the loss and the
    schedule then see another batch."""
    before = meta.get(SAMPLES_KEY)
    if before is None or int(before) == samples:
        return
    if train.global_batch_size:  # changed on purpose: nothing to fix
        log.warning("%s was trained with %d samples per weight update; this run takes %d (train.global_batch_size)",
                    name, before, samples)
        return
    log.warning("%s was trained with %d samples per weight update; this run takes %d (%d replica(s) x "
                "train.batch_size %d x %d micro-batch(es)): set train.global_batch_size: %d to keep %d on any layout",
                name, before, samples, replicas, train.batch_size, micro_batches, before, before)


def micro_batches_per_rank(model: RankModel, step: int) -> int:
    """Micro-batches each rank has run forward in training mode after update ``step``: the resumed checkpoint's count
    plus this run's updates (torch's BatchNorm ``num_batches_tracked``; ``ortflow export --state-dict`` writes it)."""
    k = model.cfg.train.gradient_accumulation_steps
    if model.resume is None:
        return step * k
    return model.resume.micro_batches_per_rank + (step - model.resume.step) * k


def save(model: RankModel, checkpoints: CheckpointManager, step: int, cursor: int, train_loss, eval_loss) -> None:
    """The checkpoint hook: check the replicas, then every rank takes part in the manager's save (its barriers)."""
    cfg = model.cfg
    meta = {
        "global_cursor": cursor, "num_train_steps": cfg.train.num_train_steps,
        "num_weight_updates": cfg.train.num_weight_updates, "train_loss": train_loss, "eval_loss": eval_loss,
        SAMPLES_KEY: cfg.train.gradient_accumulation_steps * model.dims.dp * cfg.train.batch_size,
        MICRO_BATCHES_KEY: micro_batches_per_rank(model, step),
        "num_ranks": model.comm.size, **model.layout_meta(), "config_fingerprint": cfg.section_fingerprint(),
        "rng": {"seed": cfg.train.seed, "scheme": RNG_SCHEME},
        **model.replica_check(step),
        loss_scale.META_KEY: loss_scale.checkpoint_state(model.loss_scale),
    }  # fmt: skip
    checkpoints.save(step, model.train_state(), meta)
