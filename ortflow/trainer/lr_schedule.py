"""Learning-rate schedules, computed from the weight-update step.

The engine's own ``LinearLRScheduler`` is the only one it has (and its Python arguments are swapped), so the trainer
computes the rate itself and hands it to ``update.step(grads, lr)`` every update.

For update ``step`` (0-based: the rate used by the ``step``-th optimizer step) of ``total`` updates, with peak rate
``lr``, ``w`` warm-up updates and floor ``lr_min = lr * min_lr_ratio``:

* warm-up (``step < w``): ``lr * (step + 1) / w``
* after warm-up, with progress ``p = (step - w) / max(1, total - w - 1)`` in [0, 1]:
  * constant: ``lr``
  * linear: ``lr_min + (lr - lr_min) * (1 - p)``
  * cosine: ``lr_min + (lr - lr_min) * (1 + cos(pi * p)) / 2``
  * polynomial: ``lr_min + (lr - lr_min) * (1 - p) ** power``

So the first step after warm-up uses the peak rate and the last step (``step = total - 1``) uses ``lr_min``.
"""

from __future__ import annotations

import math

from ortflow.config import LRScheduleConfig


def learning_rate(step: int, total: int, peak: float, schedule: LRScheduleConfig) -> float:
    """The learning rate of weight update ``step`` (0-based) in a run of ``total`` updates.

    Args:
        step: Index of the weight update about to happen, 0 <= step < total.
        total: Weight updates in the whole run.
        peak: The optimizer's configured learning rate.
        schedule: The schedule section of the config.

    Returns:
        The rate to set before this update's optimizer step.
    """
    if not 0 <= step < total:
        raise ValueError(f"step {step} is outside the run's {total} weight updates")
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.name == "constant":
        return peak
    floor = peak * schedule.min_lr_ratio
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    if schedule.name == "linear":
        factor = 1.0 - progress
    elif schedule.name == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # polynomial
        factor = (1.0 - progress) ** schedule.power
    return floor + (peak - floor) * factor
