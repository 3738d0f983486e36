"""AdamW, in two documented rules (the state, ``exp_avg`` and ``exp_avg_sq``, means the same in both).

``rule: torch`` is ``torch.optim.AdamW`` (Loshchilov & Hutter), at step t with g the averaged gradient::

    p   <- p * (1 - lr * wd)                          # decoupled decay first
    m   <- b1 * m + (1 - b1) * g
    v   <- b2 * v + (1 - b2) * g^2
    p   <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

computed as ``p - s * m / (sqrt(v) + eps * sqrt(1 - b2^t))`` with ``s = lr * sqrt(1 - b2^t) / (1 - b1^t)``: the same
value (to fp32 rounding) in five passes instead of seven.

``rule: engine`` is ONNX Runtime's ``AdamWOptimizer`` with ``adam_mode=1`` (the Hugging Face variant that the engine's
optimizer graph used until ortflow took the update over), reproduced operation for operation in float32 so that runs
started with the engine continue bit for bit::

    m   <- b1 * m + (1 - b1) * g
    v   <- b2 * v + ((1 - b2) * g) * g
    p   <- p - (lr_c * m) / (sqrt(v) + eps)           # epsilon added to the *uncorrected* sqrt(v)
                                                      # sqrt: the engine's own (see engine_sqrt.py)
    p   <- p - (lr * wd) * p                          # decay after the step

with ``lr_c = lr * (sqrt(1 - b2^t) / (1 - b1^t))``, every factor rounded to float32 as the engine's kernel does.
"""

from __future__ import annotations

import math

import numpy as np

from ortflow.trainer.optim.engine_sqrt import aligned_empty, engine_sqrt
from ortflow.trainer.optim.segments import adam_moments, fused_module

f32 = np.float32


def _torch_kernel(p, g, m, v, t1, t2, decay, keep, c1, b1, c2, b2, eps_hat, step_size):
    if decay and keep != 1:
        p *= keep
    adam_moments(g, m, v, t1, c1, b1, c2, b2, eps_hat)
    np.divide(m, t1, out=t1)
    t1 *= step_size
    p -= t1


def _engine_moments(p, g, m, v, t1, t2, decay, c1, b1, c2, b2):
    np.multiply(g, c1, out=t1)
    m *= b1
    m += t1
    np.multiply(g, c2, out=t1)
    t1 *= g
    v *= b2
    v += t1


def _engine_finish(p, m, root, t2, decay, eps, lr_c, lr_wd):
    root += eps
    np.multiply(m, lr_c, out=t2)
    np.divide(t2, root, out=t2)
    p -= t2
    if decay and lr_wd != 0:
        np.multiply(p, lr_wd, out=t2)
        p -= t2


class AdamW:
    """AdamW with ``rule`` ``torch`` (default) or ``engine``; see the module docstring for the exact arithmetic.

    Args:
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Epsilon.
        weight_decay: Decoupled weight decay (skipped for segments whose ``decay`` is False).
        rule: ``torch`` or ``engine``.
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1: float, beta2: float, eps: float, weight_decay: float, rule: str = "torch"):
        if rule not in ("torch", "engine"):
            raise ValueError(f"optimizer.rule must be torch or engine, got {rule!r}")
        self.beta1, self.beta2, self.eps, self.weight_decay, self.rule = beta1, beta2, eps, weight_decay, rule
        self._roots: list[np.ndarray] | None = None  # per-thread aligned scratch for the engine's sqrt

    def apply(self, update, grads, lr: float) -> None:
        t = update.step_count
        if self.rule == "torch":
            bc1, bc2 = 1.0 - self.beta1**t, 1.0 - self.beta2**t
            consts = (
                f32(1.0 - lr * self.weight_decay), f32(1.0 - self.beta1), f32(self.beta1), f32(1.0 - self.beta2),
                f32(self.beta2), f32(self.eps * math.sqrt(bc2)), f32(lr * math.sqrt(bc2) / bc1),
            )
            update.for_each_chunk(grads, _torch_kernel, "adamw_torch", *consts)
            return
        b1, b2, lr32 = f32(self.beta1), f32(self.beta2), f32(lr)
        # As the engine's kernel: std::pow(float, int64) is computed in double and rounded back to float.
        alpha_c = f32(1) - f32(float(b1) ** t)
        beta_c = f32(1) - f32(float(b2) ** t)
        lr_c = lr32 * (np.sqrt(beta_c) / alpha_c)
        update.for_each_chunk(grads, _engine_moments, "adamw_engine_moments", f32(1) - b1, b1, f32(1) - b2, b2)
        eps, lr_c, lr_wd = f32(self.eps), f32(lr_c), lr32 * f32(self.weight_decay)
        finish = fused_module().adamw_engine_finish if update.backend == "fused" else None
        if self._roots is None or len(self._roots) != update.num_groups:
            self._roots = [aligned_empty(min(update.chunk, _largest(update))) for _ in range(update.num_groups)]

        def sqrt_and_finish(group: int, i: int, part: slice) -> None:
            seg, p = update.segments[i], update.params[i][part]
            m, v = (s[part] for s in update.state_views(i))
            # The engine's approximate sqrt, bit for bit (packets counted from the tensor's start).
            root = engine_sqrt(v, seg.lo + part.start, seg.numel, self._roots[group])
            if finish is not None:
                finish(p, m, root, update.decay[i], eps, lr_c, lr_wd)
            else:
                _engine_finish(p, m, root, update.scratch_for(group)[1][: p.size], update.decay[i], eps, lr_c, lr_wd)

        update.for_each_part(sqrt_and_finish)


def _largest(update) -> int:
    return max((s.size for s in update.segments), default=1) or 1
