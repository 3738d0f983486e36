"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2), per parameter tensor::

    m   <- b1 * m + (1 - b1) * g
    v   <- b2 * v + (1 - b2) * g^2
    r   <- (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * p
    q   <- ||p|| / ||r||, clipped to [ratio_min, ratio_max]; 1 when either norm is 0
    p   <- p - lr * q * r

Bias correction as in the paper (the reference's ``do_bias_correction``); ``ratio_min``/``ratio_max`` are the
reference's trust-ratio bounds; tensors named in ``optimizer.no_weight_decay`` (biases, LayerNorm weights) get
``wd = 0`` but keep their trust ratio. The norms are whole-tensor norms: under ZeRO-1 a tensor may be split between
ranks, so the per-tensor sums of squares go through one small sum over ranks (``update.sum_across_ranks``).
"""

from __future__ import annotations

import math

import numpy as np

from ortflow.trainer.optim.segments import adam_moments, fused_module

f32 = np.float32


def _moments_kernel(p, g, m, v, t1, t2, decay, c1, b1, c2, b2, eps_hat, scale, wd):
    adam_moments(g, m, v, t1, c1, b1, c2, b2, eps_hat)
    np.divide(m, t1, out=g)  # r is built in the gradient's place: the gradient is not needed again
    if scale != 1:
        g *= scale
    if decay and wd != 0:
        np.multiply(p, wd, out=t1)
        g += t1


class Lamb:
    """LAMB with trust-ratio bounds; the state is ``exp_avg`` and ``exp_avg_sq`` as for AdamW."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1: float, beta2: float, eps: float, weight_decay: float,
                 ratio_min: float = 0.0, ratio_max: float | None = None):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.ratio_min, self.ratio_max = ratio_min, ratio_max

    def trust_ratios(self, sums: np.ndarray) -> np.ndarray:
        """Per-tensor trust ratios from [sum p^2..., sum r^2...] (float64, whole tensors)."""
        half = sums.size // 2
        w_norm, r_norm = np.sqrt(sums[:half]), np.sqrt(sums[half:])
        ratio = np.divide(w_norm, r_norm, out=np.ones_like(w_norm), where=(w_norm > 0) & (r_norm > 0))
        return np.clip(ratio, self.ratio_min, self.ratio_max if self.ratio_max is not None else np.inf)

    def apply(self, update, grads, lr: float) -> None:
        t = update.step_count
        bc1, bc2 = 1.0 - self.beta1**t, 1.0 - self.beta2**t
        # m_hat / (sqrt(v_hat) + eps) = (sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2))
        consts = (f32(1.0 - self.beta1), f32(self.beta1), f32(1.0 - self.beta2), f32(self.beta2),
                  f32(self.eps * math.sqrt(bc2)), f32(math.sqrt(bc2) / bc1), f32(self.weight_decay))
        update.for_each_chunk(grads, _moments_kernel, "lamb_moments", *consts)
        # Partial sums of squares of p and r per tensor (this rank's segments), then whole-tensor sums over ranks.
        sums = np.zeros(2 * update.num_tensors, dtype=np.float64)
        for seg, p, r in zip(update.segments, update.params, grads, strict=True):
            sums[seg.index] += float(np.dot(p, p))
            sums[update.num_tensors + seg.index] += float(np.dot(r, r))
        ratios = self.trust_ratios(update.sum_across_ranks(sums))
        axpy = fused_module().axpy_sub if update.backend == "fused" else None
        factors = [f32(lr * ratios[seg.index]) for seg in update.segments]

        def apply(group: int, i: int, part: slice) -> None:
            p, r = update.params[i][part], grads[i][part]
            if axpy is not None:
                axpy(p, r, factors[i])  # p - r * factor in one pass, as the two numpy lines below
            else:
                r *= factors[i]
                p -= r

        update.for_each_part(apply)
