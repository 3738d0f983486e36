"""Run under ``mpiexec -n 2``: MPIComm's runs exchange with ``defer_scale`` leaves the exact sums over ranks in the
gradients (in place and packed) and returns float32(1/divisor); Zero0's folded norm, clip and AdamW step then give
the bits of the eager exchange's, and every rank the same; the bucket exchange still scales and returns 1."""

import sys
import tempfile
from pathlib import Path

import numpy as np

from ortflow.config import OptimizerConfig
from ortflow.trainer.comm import MPIComm
from ortflow.trainer.comm.pending import Gradients
from ortflow.trainer.guards import clip_gradients
from ortflow.trainer.optim import Update, build_rule, decays, whole_segments
from ortflow.trainer.optim.zero import Zero0

comm = MPIComm(Path(tempfile.mkdtemp()) / "hb", 60.0)
shapes = [(129, 130), (7, 5), (3,), (200, 100), (0,), (90, 90)]
names = [f"t{i}.weight" for i in range(len(shapes))]
divisor = 3.0 * comm.size
originals = [np.random.default_rng([comm.rank, i]).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
every = [[np.random.default_rng([r, i]).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
         for r in range(comm.size)]  # fmt: skip


def sums(k: int) -> list[np.ndarray]:
    """The sums over ranks of update k's gradients (each rank's times k)."""
    return [every[0][i] * np.float32(k) + every[1][i] * np.float32(k) for i in range(len(shapes))]


assert comm.size == 2  # a + b is the same sum in any algorithm's order


def arena_grads() -> list[np.ndarray]:
    """The large gradients back to back in one buffer (one memory run, reduced in place), the small ones apart
    (packed)."""
    sizes = [int(np.prod(s)) for s in shapes]
    arena = np.empty(sum(sizes), np.float32)
    out, at = [], 0
    for shape, size, original in zip(shapes, sizes, originals, strict=True):
        if size >= 1000:
            out.append(arena[at : at + size].reshape(shape))
            at += size
        else:
            out.append(np.empty(shape, np.float32))
        out[-1][...] = original
    return out


def run(fold: bool):
    """Three updates, clipping each: (parameters, state, norms); the gradients are refilled before each exchange."""
    comm.defer_scale = False
    exchange = Zero0(comm, fold=fold)
    grads = arena_grads()
    opt = OptimizerConfig(name="adamw", weight_decay=0.1)
    params = [np.random.default_rng([9, i]).standard_normal(int(np.prod(s))).astype(np.float32)
              for i, s in enumerate(shapes)]  # fmt: skip
    update = Update(build_rule(opt), whole_segments(names, [p.size for p in params]), params,
                    decays(names, opt.no_weight_decay), backend="fused")
    norms = []
    for step in range(3):
        for g, o in zip(grads, originals, strict=True):
            g[...] = o * np.float32(step + 1)
        scalars = np.array([comm.rank + 1.0, 0.0], np.float32)
        mine = exchange.reduce(grads, divisor, scalars)
        assert scalars.tolist() == [3.0, 0.0], scalars
        if fold:
            assert isinstance(mine, Gradients) and mine.scale == np.float32(1.0 / divisor), mine.scale
            for g, s in zip(grads, sums(step + 1), strict=True):  # the exact sums, scaled by nothing
                np.testing.assert_array_equal(g, s)
        norm = exchange.norm(mine)
        clip_gradients(exchange, mine, norm, 0.5 * norm)
        update.step(mine, 1e-2)
        norms.append(norm)
    return params, update.state, norms


eager_params, eager_state, eager_norms = run(False)
fold_params, fold_state, fold_norms = run(True)
assert fold_norms == eager_norms, (fold_norms, eager_norms)
for a, b in zip(eager_params, fold_params, strict=True):
    np.testing.assert_array_equal(a, b)
for key in eager_state:
    np.testing.assert_array_equal(eager_state[key], fold_state[key])
first = comm.comm.bcast(np.concatenate(fold_params) if comm.rank == 0 else None, root=0)
assert np.array_equal(first, np.concatenate(fold_params)), "ranks differ"
assert comm._runs.views and comm._runs.small, "the plan has a run in place and a pack"

comm.defer_scale, comm.bucket_values = True, 4096  # buckets never defer: they scale and say so
grads = arena_grads()
assert comm.average_gradients(grads, divisor, np.zeros(2, np.float32)) == 1
for g, s in zip(grads, sums(1), strict=True):
    np.testing.assert_array_equal(g, s * np.float32(1.0 / divisor))
comm.close()
print(f"rank {comm.rank} exchange fold ok", flush=True)
sys.exit(0)
