"""SGD as ``torch.optim.SGD`` (momentum, dampening, Nesterov, L2 weight decay added to the gradient)::

    d   <- g + wd * p
    buf <- d                              (first step)
    buf <- mu * buf + (1 - dampening) * d (later steps)
    d   <- d + mu * buf  (nesterov)  |  d <- buf  (momentum)
    p   <- p - lr * d

Without momentum and decay this is ``p - lr * g``, the arithmetic of the engine's ``SGDOptimizerV2`` graph, so runs
started with the engine's SGD continue bit for bit. The state ``momentum`` exists only when momentum > 0.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def _plain_kernel(p, g, t1, t2, decay, wd, lr, mu, damp, nesterov, first):
    if decay and wd != 0:
        np.multiply(p, wd, out=t1)
        g += t1
    np.multiply(g, lr, out=t1)
    p -= t1


def _momentum_kernel(p, g, buf, t1, t2, decay, wd, lr, mu, damp, nesterov, first):
    if decay and wd != 0:
        np.multiply(p, wd, out=t1)
        g += t1
    if first:
        buf[...] = g
    else:
        buf *= mu
        np.multiply(g, damp, out=t1)
        buf += t1
    if nesterov:
        np.multiply(buf, mu, out=t1)
        g += t1
    else:
        g = buf
    np.multiply(g, lr, out=t1)
    p -= t1


class SGD:
    """Stochastic gradient descent with optional momentum, dampening, Nesterov and L2 weight decay."""

    def __init__(
        self, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
    ):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("optimizer.nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
        self.momentum, self.dampening, self.nesterov, self.weight_decay = momentum, dampening, nesterov, weight_decay
        self.state_names = ("momentum",) if momentum > 0 else ()

    def apply(self, update, grads, lr: float) -> None:
        consts = (f32(self.weight_decay), f32(lr), f32(self.momentum), f32(1.0 - self.dampening), self.nesterov,
                  update.step_count == 1)
        if self.momentum > 0:
            update.for_each_chunk(grads, _momentum_kernel, "sgd_momentum", *consts)
        else:
            update.for_each_chunk(grads, _plain_kernel, "sgd_plain", *consts)
