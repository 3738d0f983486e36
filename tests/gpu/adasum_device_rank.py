"""Run under mpiexec by test_gpu_adasum.py: the device Adasum exchange (AdasumDevice) in both modes on GPU buffers.

gradients: ``reduce`` combines the ranks' mean gradients; deltas: the parameters start equal on every rank, each rank
subtracts its own delta on the device (the local step), and ``gather`` leaves start + Adasum(deltas). Results saved
per rank as float32 arrays.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ortflow.trainer.comm import DeviceBuffer, attach_nccl, create_communicator  # noqa: E402
from ortflow.trainer.optim.device import AdasumDevice  # noqa: E402
from tests.trainer.adasum_rank import COUNTS, contribution  # noqa: E402

START_SEED = 5


def _buffers(cupy, flat: np.ndarray) -> tuple[list, list]:
    arrays, offset = [], 0
    for count in COUNTS:
        arrays.append(cupy.asarray(flat[offset : offset + count]) if count else cupy.empty(0, cupy.float32))
        offset += count
    return arrays, [DeviceBuffer(a.data.ptr, a.size, f"t{i}") for i, a in enumerate(arrays)]


def main() -> None:
    import cupy

    out = Path(sys.argv[1])
    group = create_communicator(out / ".ranks", timeout_s=60)
    comm = attach_nccl(group, group.local_rank)
    rank, size = comm.rank, comm.size
    # gradients mode: the loop's divisor is micro-batches (2) x ranks; each rank's own mean is its sum / 2
    grads, grad_buffers = _buffers(cupy, 2.0 * contribution("random", rank, size))
    exchange = AdasumDevice(comm, grad_buffers, "gradients")  # params unused in this mode
    scalars = np.array([float(rank + 1), 0.0], dtype=np.float32)
    mine = exchange.reduce(grad_buffers, 2.0 * size, scalars)
    np.save(out / f"grad-rank{rank}.npy", np.concatenate([cupy.asnumpy(a) for a in grads]))
    np.save(out / f"grad-norm{rank}.npy", np.array([exchange.norm(mine)]))
    np.save(out / f"grad-scalars{rank}.npy", scalars)
    # deltas mode
    start = np.random.default_rng(START_SEED).normal(size=sum(COUNTS)).astype(np.float32)
    params, param_buffers = _buffers(cupy, start)
    _, step_grads = _buffers(cupy, contribution("random", rank, size))
    exchange = AdasumDevice(comm, param_buffers, "deltas")
    exchange.reduce(step_grads, float(size), np.zeros(2, dtype=np.float32))
    delta, _ = _buffers(cupy, contribution("random", rank, size))
    for p, d in zip(params, delta, strict=True):  # the local step, on the device: p += delta_rank
        p += d
    exchange.gather()
    np.save(out / f"delta-rank{rank}.npy", np.concatenate([cupy.asnumpy(a) for a in params]))
    comm.close()


if __name__ == "__main__":
    main()
