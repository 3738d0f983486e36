"""One-pass host kernels: each rule's float32 arithmetic in one loop over its arrays, compiled by Numba.

The numpy rules (adamw.py, sgd.py, lamb.py) run a dozen numpy operations per cache-sized chunk; these loops perform
the same float32 operations in the same order on each element, reading every array once and writing it once, so the
update costs one pass over memory (the engine's fused AdamW kernel does the same). No ``fastmath``: LLVM then keeps
IEEE semantics (no FMA contraction, no reassociation, exact ``sqrt`` and division), so every element gets the bits of
the numpy rule (tests/trainer/test_optim_fused.py checks it on random and edge-case inputs).
Every kernel that reads the gradient takes its owed float32 factors ``gs`` (the mean's scale) and ``gc`` (clipping)
and reads ``(g[i] * gs) * gc``: the bits of the eager passes, since a factor of 1 is exact (comm/pending.py).
``nogil``: the update's own thread pool runs one kernel per group of chunks in parallel (no Numba thread pool, so
ranks x threads stays what the launcher chose). ``cache``: compiled once per machine and reused by every rank
(compiling all kernels takes a few seconds).

Measured against numpy on cache-sized chunks, numpy with whole-array temporaries and the engine's AdamW graph:
bench/reports/optim-cpu.md.
"""

from __future__ import annotations

import math

from numba import njit

_jit = njit(nogil=True, cache=True, fastmath=False, error_model="numpy", boundscheck=False)


@_jit
def adamw_torch(p, g, m, v, decay, gs, gc, keep, c1, b1, c2, b2, eps_hat, step_size):  # pragma: no cover
    scale = decay and keep != 1
    for i in range(p.size):
        pi = p[i]
        if scale:
            pi = pi * keep
        gi = (g[i] * gs) * gc
        mi = m[i] * b1 + gi * c1
        vi = v[i] * b2 + (gi * gi) * c2
        m[i] = mi
        v[i] = vi
        p[i] = pi - (mi / (math.sqrt(vi) + eps_hat)) * step_size


@_jit
def adamw_engine_moments(p, g, m, v, decay, gs, gc, c1, b1, c2, b2):  # pragma: no cover - compiled
    for i in range(g.size):
        gi = (g[i] * gs) * gc
        m[i] = m[i] * b1 + gi * c1
        v[i] = v[i] * b2 + (gi * c2) * gi


@_jit
def adamw_engine_finish(p, m, root, decay, eps, lr_c, lr_wd):  # pragma: no cover - compiled
    scale = decay and lr_wd != 0
    for i in range(p.size):
        pi = p[i] - (m[i] * lr_c) / (root[i] + eps)
        if scale:
            pi = pi - pi * lr_wd
        p[i] = pi


@_jit
def sgd_plain(p, g, decay, gs, gc, wd, lr, mu, damp, nesterov, first):  # pragma: no cover - compiled
    add_decay = decay and wd != 0
    for i in range(p.size):
        gi = (g[i] * gs) * gc
        if add_decay:
            gi = gi + p[i] * wd
        p[i] = p[i] - gi * lr


@_jit
def sgd_momentum(p, g, buf, decay, gs, gc, wd, lr, mu, damp, nesterov, first):  # pragma: no cover - compiled
    add_decay = decay and wd != 0
    for i in range(p.size):
        gi = (g[i] * gs) * gc
        if add_decay:
            gi = gi + p[i] * wd
        bi = gi if first else buf[i] * mu + gi * damp
        buf[i] = bi
        gi = gi + bi * mu if nesterov else bi
        p[i] = p[i] - gi * lr


@_jit
def lamb_moments(p, g, m, v, decay, gs, gc, c1, b1, c2, b2, eps_hat, scale, wd):  # pragma: no cover
    scaled = scale != 1
    add_decay = decay and wd != 0
    for i in range(p.size):
        gi = (g[i] * gs) * gc
        mi = m[i] * b1 + gi * c1
        vi = v[i] * b2 + (gi * gi) * c2
        m[i] = mi
        v[i] = vi
        r = mi / (math.sqrt(vi) + eps_hat)
        if scaled:
            r = r * scale
        if add_decay:
            r = r + p[i] * wd
        g[i] = r


@_jit
def axpy_sub(p, r, factor):  # pragma: no cover - compiled
    for i in range(p.size):
        p[i] = p[i] - r[i] * factor
