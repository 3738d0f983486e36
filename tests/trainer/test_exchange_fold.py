"""The fold: the mean's scale and the clip factor applied by the norm and the update as they read the gradients give
the bits of the eager passes (scale pass, norm, clip pass, step), for every rule, backend, clip and divisor."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.config import OptimizerConfig
from ortflow.trainer.comm import SingleProcessComm
from ortflow.trainer.comm.pending import NORM_CHUNK, Gradients, gradient_norm, scale_gradients
from ortflow.trainer.guards import clip_gradients
from ortflow.trainer.optim import Update, build_rule, decays, whole_segments
from ortflow.trainer.optim.zero import Zero0, Zero1

f32 = np.float32
#: One tensor over two norm chunks and over the numpy backend's chunk; odd sizes; a scalar.
SIZES = (NORM_CHUNK + 4461, 33, 5000, 1, 4099)
NAMES = ("big.weight", "h.bias", "h.weight", "norm.weight", "tail.weight")
RULES = {
    "adamw-torch": OptimizerConfig(name="adamw", weight_decay=0.1, no_weight_decay=("*.bias",)),
    "adamw-engine": OptimizerConfig(name="adamw", rule="engine", epsilon=1e-8, weight_decay=0.05,
                                    no_weight_decay=("*.bias",)),
    "sgd-plain": OptimizerConfig(name="sgd", weight_decay=0.01),
    "sgd-momentum": OptimizerConfig(name="sgd", momentum=0.9),
    "sgd-nesterov": OptimizerConfig(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening": OptimizerConfig(name="sgd", momentum=0.5, dampening=0.3, weight_decay=0.02),
    "lamb": OptimizerConfig(name="lamb", weight_decay=0.01, ratio_min=0.5, ratio_max=2.0,
                            no_weight_decay=("*.bias",)),
}
#: k micro-batches x ranks (x the loss scale): 1 (nothing owed), 2 (exact), 3 (rounds), 2 x 1024 (a loss scale).
DIVISORS = (1.0, 2.0, 3.0, 2.0 * 1024)
STEPS = 3


def sums(rng, size: int, divisor: float) -> np.ndarray:
    """Summed gradients over many magnitudes: exact zeros, subnormals (also after the scale), tiny to large, signs."""
    magnitude = rng.choice(np.array([0.0, 1e-44, 1e-40, 1e-37, 1e-30, 1e-8, 1e-3, 1.0, 1e6, 1e15]), size)
    return (rng.standard_normal(size) * magnitude * divisor).astype(np.float32)


def make_update(rule: str, backend: str) -> tuple[Update, list[np.ndarray]]:
    opt = RULES[rule]
    params = [np.random.default_rng([1, i]).standard_normal(s).astype(np.float32) for i, s in enumerate(SIZES)]
    update = Update(build_rule(opt), whole_segments(NAMES, SIZES), params, decays(NAMES, opt.no_weight_decay),
                    backend=backend)
    return update, params


def eager(rule, backend, divisor, max_norm, inputs):
    """The sequence before the fold, written out: scale pass, norm, clip pass, step on plain arrays."""
    update, params = make_update(rule, backend)
    norms = []
    for k, step_sums in enumerate(inputs):
        grads = [s.copy() for s in step_sums]
        for g in grads:
            g *= f32(1.0 / divisor)
        norm = gradient_norm(grads)
        if max_norm is not None and norm > max_norm:
            for g in grads:
                g *= f32(max_norm / (norm + 1e-6))
        update.step(grads, 1e-2 * (1 + k))
        norms.append(norm)
    return params, update.state, norms


def folded(rule, backend, divisor, max_norm, inputs):
    """The trainer's sequence with the fold: Zero0's reduce leaves the sums, clip_gradients owes its factor."""
    update, params = make_update(rule, backend)
    exchange = Zero0(SingleProcessComm(), fold=True)
    norms = []
    for k, step_sums in enumerate(inputs):
        grads = [s.copy() for s in step_sums]
        mine = exchange.reduce(grads, divisor, np.zeros(2, np.float32))
        assert isinstance(mine, Gradients) and mine.scale == f32(1.0 / divisor)
        assert all(np.array_equal(g, s) for g, s in zip(grads, step_sums, strict=True)), "reduce wrote the sums"
        norm = exchange.norm(mine)
        assert all(np.array_equal(g, s) for g, s in zip(grads, step_sums, strict=True)), "the norm wrote the sums"
        clip_gradients(exchange, mine, norm, max_norm)
        assert mine.clip == (f32(max_norm / (norm + 1e-6)) if max_norm is not None and norm > max_norm else 1)
        update.step(mine, 1e-2 * (1 + k))
        norms.append(norm)
    return params, update.state, norms


def inputs_for(divisor: float) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(int(divisor))
    return [[sums(rng, s, divisor) for s in SIZES] for _ in range(STEPS)]


def assert_same(a, b, label: str) -> None:
    (pa, sa, na), (pb, sb, nb) = a, b
    assert na == nb, f"{label}: norms {na} vs {nb}"
    for name, x, y in zip(NAMES, pa, pb, strict=True):
        assert np.array_equal(x, y), f"{label}: parameter {name} differs in {np.count_nonzero(x != y)} values"
    for key in sa:
        assert np.array_equal(sa[key], sb[key]), f"{label}: state {key} differs"


@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("clip", [None, "clip"])
@pytest.mark.parametrize("backend", ["numpy", "fused"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_folded_scales_give_the_bits_of_the_eager_passes(rule, backend, clip, divisor):
    inputs = inputs_for(divisor)
    # Clipping below every update's norm, so it applies each time (its factor rounds: not a power of two).
    max_norm = 0.7 * min(gradient_norm([s * f32(1.0 / divisor) for s in step]) for step in inputs) if clip else None
    label = f"{rule} {backend} clip={clip} divisor={divisor}"
    want, got = eager(rule, backend, divisor, max_norm, inputs), folded(rule, backend, divisor, max_norm, inputs)
    assert_same(want, got, label)
    moved = sum(np.count_nonzero(p != q) for p, q in zip(want[0], make_update(rule, backend)[1], strict=True))
    assert moved > sum(SIZES) // 2, f"{label}: the updates moved only {moved} values"  # a no-op would also agree


def test_one_multiplication_by_scale_times_clip_would_differ():
    # The test above can fail: folding s * c into one factor (the tempting shortcut) changes bits on these inputs.
    divisor, inputs = 3.0, inputs_for(3.0)
    norm0 = gradient_norm([s * f32(1.0 / divisor) for s in inputs[0]])
    max_norm = 0.7 * norm0
    s, c = f32(1.0 / divisor), f32(max_norm / (norm0 + 1e-6))
    x = inputs[0][0]
    assert np.count_nonzero((x * s) * c != x * (s * c)) > 100
    want = eager("adamw-torch", "fused", divisor, max_norm, inputs[:1])
    update, params = make_update("adamw-torch", "fused")
    update.step(Gradients([g.copy() for g in inputs[0]], scale=s * c), 1e-2)
    assert not all(np.array_equal(p, q) for p, q in zip(want[0], params, strict=True))


def test_norm_folds_both_factors_and_reads_chunks_where_they_lie():
    rng = np.random.default_rng(3)
    arena = rng.standard_normal(3 * NORM_CHUNK + 1).astype(np.float32)
    grads = [arena[1 : 2 * NORM_CHUNK + 7], arena[2 * NORM_CHUNK + 7 :]]  # unaligned views, several chunks
    s, c = f32(1 / 3), f32(0.37)
    scaled = [(g * s) * c for g in grads]
    owed = Gradients(grads, scale=s, clip=c)
    assert gradient_norm(owed) == gradient_norm(scaled)
    assert gradient_norm(owed) == pytest.approx(float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in scaled))),
                                                rel=1e-6)
    assert np.array_equal(arena[1 : 2 * NORM_CHUNK + 7], grads[0]) and grads[0].base is arena  # nothing written
    overflow = Gradients([np.array([3e38, 1.0], np.float32)], scale=f32(0.5))
    assert gradient_norm(overflow) == float("inf")  # fp16 loss scaling's overflow still shows


def test_a_second_clip_settles_the_first_into_the_arrays():
    x = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    owed = Gradients([x.copy()], scale=f32(1 / 3))
    scale_gradients(owed, 0.3)
    scale_gradients(owed, 0.7)
    want = ((x * f32(1 / 3)) * f32(0.3)) * f32(0.7)
    assert owed.clip == f32(0.7) and owed.scale == 1
    assert np.array_equal((owed[0] * owed.scale) * owed.clip, want)


def test_zero0_without_fold_scales_eagerly_and_the_device_update_refuses_owed_factors():
    grads = [np.full(4, 3.0, np.float32)]
    mine = Zero0(SingleProcessComm()).reduce(grads, 3.0, np.zeros(2, np.float32))
    assert not isinstance(mine, Gradients) and np.array_equal(grads[0], np.full(4, f32(3.0) * f32(1 / 3)))
    from ortflow.trainer.optim.device import DeviceUpdate

    with pytest.raises(TypeError, match="owed"):
        DeviceUpdate.step(object.__new__(DeviceUpdate), Gradients([], scale=0.5), 0.1)


@pytest.mark.parametrize("backend", ["numpy", "fused"])
def test_zero1_shard_folded_gives_the_bits_of_the_eager_shard(backend):
    opt = RULES["lamb"]
    results = []
    for fold in (False, True):
        params = [np.random.default_rng([1, i]).standard_normal(s).astype(np.float32) for i, s in enumerate(SIZES)]
        exchange = Zero1(SingleProcessComm(), NAMES, params, 0, 1, fold=fold)
        update = Update(build_rule(opt), exchange.segments, exchange.my_params(),
                        decays([s.name for s in exchange.segments], opt.no_weight_decay), exchange.sum_across_ranks,
                        len(NAMES), backend=backend)
        norms = []
        for k, step in enumerate(inputs_for(3.0)):
            grads = [g.copy() for g in step]
            mine = exchange.reduce(grads, 3.0, np.zeros(2, np.float32))
            assert isinstance(mine, Gradients) == fold
            norm = exchange.norm(mine)
            clip_gradients(exchange, mine, norm, 0.5 * norm)
            update.step(mine, 1e-2 * (1 + k))
            exchange.gather()
            norms.append(norm)
        results.append((params, update.state, norms))
    assert_same(results[0], results[1], f"zero-1 lamb {backend}")
