"""What the pipeline and tensor-parallel loops report after an update: progress line, TensorBoard, checkpoint meta."""

from __future__ import annotations

from ortflow.config import RunConfig
from ortflow.trainer.metrics import Progress, TensorBoardLog

#: How a resumed run replays the graph's randomness (recorded in every checkpoint's meta).
RNG_SCHEME = "onnxruntime.set_seed(seed + step) before each update"


def report_window(progress: Progress, tensorboard: TensorBoardLog | None, step: int, total: int, elapsed: float,
                  window_samples: int, tokens_per_sample: int | None, fields: dict) -> None:
    """Rank 0's progress line and TensorBoard scalars for the window that ends at ``step``.

    Args:
        fields: ``loss``, ``eval_loss``, ``lr`` and ``grad_norm`` of the update; throughput is added here.
    """
    samples_per_s = window_samples / elapsed if elapsed > 0 else None
    tokens_per_s = samples_per_s * tokens_per_sample if samples_per_s and tokens_per_sample else None
    progress.report(step, {**fields, "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s},
                    final=step == total)
    if tensorboard is not None:
        tensorboard.scalars(step, {"train/loss": fields["loss"], "eval/loss": fields["eval_loss"],
                                   "train/learning_rate": fields["lr"], "train/grad_norm": fields["grad_norm"],
                                   "train/samples_per_s": samples_per_s})
        tensorboard.flush()


def checkpoint_meta(cfg: RunConfig, world: int, cursor: int, train_loss, eval_loss, **layout) -> dict:
    """The meta.json fields of a pipeline or tensor-parallel checkpoint; ``layout`` adds the parallel sizes."""
    return {
        "global_cursor": cursor, "num_train_steps": cfg.train.num_train_steps,
        "num_weight_updates": cfg.train.num_weight_updates, "train_loss": train_loss, "eval_loss": eval_loss,
        "num_ranks": world, **layout, "config_fingerprint": cfg.section_fingerprint(),
        "rng": {"seed": cfg.train.seed, "scheme": RNG_SCHEME},
    }  # fmt: skip
