"""Learning-rate schedules, computed from the weight-update step.

The engine's own ``LinearLRScheduler`` is the only one it has (and its Python arguments are swapped), so the trainer
computes the rate itself and hands it to ``update.step(grads, lr)`` every update.

Update ``s`` (0-based: the ``s``-th optimizer step) of ``T`` updates, with peak rate ``lr``, ``W`` warm-up updates
and ``r = min_lr_ratio``, uses ``lr * f(s)``.

``indexing: huggingface`` (default) is Hugging Face ``transformers``' ``get_*_schedule_with_warmup`` (an update uses
the multiplier of the number of updates before it, as ``LambdaLR`` stepped after each optimizer step gives)::

    warm-up (s < W):  f = s / W                      (the first update of a warm-up uses lr 0)
    after, with p = (s - W) / max(1, T - W):
      constant:     f = 1                                            get_constant_schedule_with_warmup
      linear:       f = r + (1 - r) * max(0, 1 - p)                  get_linear_schedule_with_warmup (r = 0)
      cosine:       f = r + (1 - r) * max(0, (1 + cos(pi * p)) / 2)  get_cosine_schedule_with_warmup,
                                                                     ..._with_min_lr_schedule_with_warmup (r > 0)
      polynomial:   f = r + (1 - r) * (1 - p) ** power               get_polynomial_decay_schedule_with_warmup
                                                                     (lr_end = lr * r)

With ``W = 0`` these are also torch's schedulers of the same name stepped once per update: ``LinearLR(start_factor=1,
end_factor=0, total_iters=T)``, ``CosineAnnealingLR(T_max=T, eta_min=lr * r)``, ``PolynomialLR(total_iters=T,
power=power)`` (r = 0).

``indexing: training_runner`` is ONNX Runtime's TrainingRunner indexing (ortflow's rule before it followed Hugging
Face): warm-up ``f = (s + 1) / W``, then ``p = (s - W) / max(1, T - W - 1)``, so the peak is used by updates
``W - 1`` and ``W`` and the last update uses exactly ``r``.
"""

from __future__ import annotations

import math

from ortflow.config import LRScheduleConfig


def multiplier(step: int, total: int, schedule: LRScheduleConfig) -> float:
    """The factor of the peak rate for weight update ``step`` (0-based) of ``total`` (see the module docstring)."""
    if not 0 <= step < total:
        raise ValueError(f"step {step} is outside the run's {total} weight updates")
    warmup, floor = schedule.warmup_steps, schedule.min_lr_ratio
    runner = schedule.indexing == "training_runner"
    if step < warmup:
        return (step + 1) / warmup if runner else step / warmup
    if schedule.name == "constant":
        return 1.0
    if runner:
        progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    else:
        progress = (step - warmup) / max(1, total - warmup)
    if schedule.name == "linear":
        factor = max(0.0, 1.0 - progress)
    elif schedule.name == "cosine":
        factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    else:  # polynomial
        factor = max(0.0, 1.0 - progress) ** schedule.power
    return floor + (1.0 - floor) * factor


def learning_rate(step: int, total: int, peak: float, schedule: LRScheduleConfig) -> float:
    """The learning rate of weight update ``step`` (0-based) in a run of ``total`` updates.

    Args:
        step: Index of the weight update about to happen, 0 <= step < total.
        total: Weight updates in the whole run.
        peak: The optimizer's configured learning rate.
        schedule: The schedule section of the config.

    Returns:
        The rate to set before this update's optimizer step: ``peak * multiplier(step, total, schedule)``.
    """
    return peak * multiplier(step, total, schedule)
