"""The fused CuPy update kernels against the host (numpy) rules, and ZeRO-1 over NCCL: needs CUDA GPUs and CuPy.

The device kernels perform each host rule's float32 operations in the same order with round-to-nearest intrinsics
(no FMA), so AdamW (torch) and SGD must match the host update bit for bit on the same inputs; Lamb's norms are summed
in float64 on the device and by float32 dot products on the host, so its trust ratios (and parameters) agree to fp32
rounding only; the engine rule differs from the host by the CPU engine's approximate sqrt (host) vs an exact one.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ortflow import cuda_libs
from ortflow.config import OptimizerConfig
from ortflow.trainer.optim import build_rule, build_update, whole_segments


def _ready() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    count, why = cuda_libs.gpu_count()
    return None if count >= 1 else f"needs a GPU ({why or 'none found'})"


REASON = _ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

NAMES = ("a.weight", "a.bias", "big.weight", "s")
SIZES = (700, 33, 300_000, 1)


class _Buf:
    def __init__(self, array):
        self.array = array
        self.ptr, self.count = array.data.ptr, array.size


@pytest.mark.parametrize("opt, exact", [
    (OptimizerConfig(weight_decay=0.1, no_weight_decay=("*bias",)), True),
    (OptimizerConfig(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.01), True),
    (OptimizerConfig(name="sgd"), True),
    (OptimizerConfig(name="lamb", weight_decay=0.01, ratio_max=3.0), False),
    (OptimizerConfig(rule="engine", weight_decay=0.01), False),
])
def test_device_update_matches_the_host_rule(opt, exact):
    import cupy as cp

    from ortflow.trainer.optim.device import DeviceUpdate

    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
    host = [p.copy() for p in init]
    dev = [cp.asarray(p) for p in init]
    segs = whole_segments(NAMES, SIZES)
    host_update = build_update(opt, segs, host)
    flags = [not n.endswith("bias") for n in NAMES] if opt.no_weight_decay else [True] * len(NAMES)
    stream = cp.cuda.Stream(non_blocking=True)
    device_update = DeviceUpdate(build_rule(opt), segs, [d.data.ptr for d in dev], flags, stream)
    for k in range(20):
        grads = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
        host_update.step([g.copy() for g in grads], 1e-2 * (1 + k % 3))
        device_update.step([_Buf(cp.asarray(g)) for g in grads], 1e-2 * (1 + k % 3))
    for h, d in zip(host, dev, strict=True):
        if exact:
            assert np.array_equal(h, cp.asnumpy(d))
        else:
            np.testing.assert_allclose(cp.asnumpy(d), h, rtol=0, atol=2e-5 * max(1.0, float(np.abs(h).max())))
    device_update.to_host()
    for i in range(len(segs)):
        for a, b in zip(device_update.state_views(i), host_update.state_views(i), strict=True):
            if exact:
                assert np.array_equal(a, b)
