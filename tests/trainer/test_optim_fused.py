"""The fused (Numba) backend gives the bits of the numpy rules, rule by rule, with and without sharding and threads."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ortflow.config import OptimizerConfig
from ortflow.trainer.optim import Update, build_rule, decays, whole_segments
from ortflow.trainer.optim.segments import default_backend
from ortflow.trainer.optim.zero import shard_segments

SIZES = (700, 33, 20000, 1, 4099)  # larger than a chunk, odd sizes (the engine sqrt's tails), a scalar
NAMES = ("h.weight", "h.bias", "big.weight", "norm.weight", "tail.weight")
RULES = {
    "adamw-torch": OptimizerConfig(name="adamw", weight_decay=0.1, no_weight_decay=("*.bias",)),
    "adamw-engine": OptimizerConfig(name="adamw", rule="engine", epsilon=1e-8, weight_decay=0.05,
                                    no_weight_decay=("*.bias",)),
    "sgd-plain": OptimizerConfig(name="sgd", weight_decay=0.01),
    "sgd-nesterov": OptimizerConfig(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening": OptimizerConfig(name="sgd", momentum=0.5, dampening=0.3),
    "lamb": OptimizerConfig(name="lamb", weight_decay=0.01, ratio_min=0.5, ratio_max=2.0,
                            no_weight_decay=("*.bias",)),
}


def hard_values(rng, size: int) -> np.ndarray:
    """Gradients over many magnitudes (subnormal to 1e6), exact zeros and signs: where rounding differences show."""
    scale = rng.choice(np.array([0.0, 1e-42, 1e-30, 1e-8, 1e-3, 1.0, 1e6]), size)
    return (rng.standard_normal(size) * scale).astype(np.float32)


def run(opt: OptimizerConfig, backend: str, threads: int = 1, chunk: int = 65536, world: int = 1):
    """Eight updates of every rank's segments (ZeRO-1 cut for ``world`` > 1); final parameters and states."""
    rng = np.random.default_rng(7)
    init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
    grads = [[hard_values(rng, s) for s in SIZES] for _ in range(8)]
    params = [p.copy() for p in init]
    states = []
    for rank in range(world):
        segs = whole_segments(NAMES, SIZES) if world == 1 else shard_segments(NAMES, SIZES, rank, world)
        views = [params[s.index][s.lo : s.hi] for s in segs]
        update = Update(build_rule(opt), segs, views, decays([s.name for s in segs], opt.no_weight_decay),
                        num_tensors=len(NAMES), chunk=chunk, threads=threads, backend=backend)
        for k, step_grads in enumerate(grads):
            update.step([step_grads[s.index][s.lo : s.hi].copy() for s in segs], 1e-2 * (1 + k % 3))
        states.append(update.state)
    return params, states


@pytest.mark.parametrize("rule", sorted(RULES))
def test_fused_backend_gives_the_bits_of_the_numpy_rule(rule):
    ref_params, ref_states = run(RULES[rule], "numpy")
    params, states = run(RULES[rule], "fused")
    for name, a, b in zip(NAMES, params, ref_params, strict=True):
        assert np.array_equal(a, b), f"{rule}: {name} differs by up to {np.abs(a - b).max()}"
    for key in ref_states[0]:
        assert np.array_equal(states[0][key], ref_states[0][key]), f"{rule}: state {key} differs"
    # The run really moved every parameter (a kernel that did nothing would also be 'equal' if both did nothing).
    rng = np.random.default_rng(7)
    init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
    assert all(not np.array_equal(a, b) for a, b in zip(params, init, strict=True))


@pytest.mark.parametrize("rule", ["adamw-torch", "adamw-engine", "lamb"])
def test_fused_backend_matches_numpy_on_zero1_shards_with_threads(rule):
    # Shards that start and end inside tensors (ZeRO-1 on 3 ranks), many small chunks dealt to 3 threads.
    ref_params, _ = run(RULES[rule], "numpy", world=3)
    params, _ = run(RULES[rule], "fused", threads=3, chunk=512, world=3)
    for a, b in zip(params, ref_params, strict=True):
        assert np.array_equal(a, b)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        Update(build_rule(RULES["sgd-plain"]), whole_segments(["w"], [4]), [np.zeros(4, np.float32)], [True],
               backend="cuda")


def test_without_numba_the_default_backend_is_numpy_with_a_warning():
    # A fresh interpreter where `import numba` fails, as in an environment installed without dependencies.
    code = (
        "import sys, logging; sys.modules['numba'] = None; logging.basicConfig(level=logging.WARNING)\n"
        "import numpy as np\n"
        "from ortflow.config import OptimizerConfig\n"
        "from ortflow.trainer.optim import build_update, whole_segments\n"
        "p = np.ones(8, np.float32)\n"
        "u = build_update(OptimizerConfig(), whole_segments(['w'], [8]), [p])\n"
        "u.step([np.ones(8, np.float32)], 0.1)\n"
        "print(u.backend, float(p[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    backend, value = out.stdout.split()
    assert backend == "numpy" and float(value) < 1.0
    assert "numba is not installed" in out.stderr


def test_with_numba_the_default_backend_is_fused():
    assert default_backend() == "fused"
    update = Update(build_rule(RULES["sgd-plain"]), whole_segments(["w"], [4]), [np.zeros(4, np.float32)], [True])
    assert update.backend == "fused"


def test_engine_sqrt_in_place_gives_the_bits_of_the_copying_path():
    from ortflow.trainer.optim.engine_sqrt import aligned_empty, engine_sqrt

    rng = np.random.default_rng(5)
    out = aligned_empty(5000)
    assert out.ctypes.data % 64 == 0
    direct = 0
    for numel in (1, 3, 4, 7, 8, 4099):
        v = (np.abs(rng.standard_normal(numel)) * rng.choice([1e-30, 1e-8, 1.0, 1e6], numel)).astype(np.float32)
        for lo, hi in ((0, numel), (0, numel - numel % 4), (numel // 2, numel), (4, numel), (1, numel)):
            if not 0 <= lo < hi <= numel:
                continue
            part = v[lo:hi]
            copied = engine_sqrt(part, lo, numel).copy()
            in_place = engine_sqrt(part, lo, numel, out)
            direct += in_place.base is out.base
            assert np.array_equal(copied, in_place), (numel, lo, hi)
    assert direct > 0  # the in-place path really ran


def test_a_run_too_small_to_repay_numbas_start_keeps_the_numpy_kernels():
    from ortflow.trainer.optim import build_update
    from ortflow.trainer.optim.segments import FUSED_MIN_WORK

    assert default_backend(FUSED_MIN_WORK - 1) == "numpy" and default_backend(FUSED_MIN_WORK) == "fused"
    segments, params = whole_segments(["w", "b"], [6, 2]), [np.zeros(6, np.float32), np.zeros(2, np.float32)]
    small = build_update(OptimizerConfig(), segments, params, num_updates=FUSED_MIN_WORK // 8 - 1)
    large = build_update(OptimizerConfig(), segments, params, num_updates=FUSED_MIN_WORK // 8)
    assert (small.backend, large.backend) == ("numpy", "fused")  # 8 elements x num_updates against the bound
