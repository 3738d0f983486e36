"""The guard every weight update passes: a non-finite loss or gradient norm stops the job, naming the step.

A NaN or an infinity in the loss or the gradients would be written into the parameters by the optimizer step and from
there into every later checkpoint. The loop calls :func:`check_update` after the gradient all-reduce and before the
optimizer step, with values that are identical on every rank (the mean loss and the norm of the averaged gradients),
so every rank decides alike, at the same update, without another collective. No checkpoint is written for the bad
update: the last good checkpoint stays the newest.

Mixed precision with dynamic loss scaling overflows on purpose now and then; there the same function tells the loop
to skip the update (``skip_overflow=True``) instead of stopping.
"""

from __future__ import annotations

import math


class NonFiniteError(ValueError):
    """The loss or the gradient norm of a weight update is NaN or infinite."""


def check_update(step: int, loss: float, grad_norm: float | None, skip_overflow: bool = False) -> bool:
    """Whether the optimizer may apply this update.

    Args:
        step: The weight update about to be applied (1-based, as checkpoints count).
        loss: Mean training loss over ranks and micro-batches of this update.
        grad_norm: Global L2 norm of the averaged gradients (None when not computed).
        skip_overflow: Loss scaling is on: a non-finite value is an fp16 overflow, the update is skipped.

    Returns:
        True to apply the update; False to skip it (only with ``skip_overflow``).

    Raises:
        NonFiniteError: naming the step, what was non-finite, and what to try.
    """
    bad = [name for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if value is not None and not math.isfinite(value)]  # fmt: skip
    if not bad:
        return True
    if skip_overflow:
        return False
    values = f"loss {loss}, gradient norm {grad_norm}"
    raise NonFiniteError(
        f"weight update {step}: non-finite {' and '.join(bad)} ({values}); the update was not applied and the last "
        f"good checkpoint stays the newest. Lower optimizer.learning_rate, set optimizer.max_grad_norm, or check the "
        f"data for extreme values (prepare-data refuses NaN/inf), then resume with `ortflow train`"
    )


def clip_gradients(exchange, grads, grad_norm: float, max_norm: float | None) -> None:
    """Scale ``grads`` in place to ``max_norm`` when their global norm exceeds it (optimizer.max_grad_norm).

    Every rank holds the same ``grad_norm``, so every rank clips alike; the engine's own clipping operator is not
    deterministic, so clipping is done here, through the exchange that owns the buffers (host or device).
    """
    if max_norm is not None and grad_norm > max_norm:
        exchange.scale(grads, max_norm / (grad_norm + 1e-6))
