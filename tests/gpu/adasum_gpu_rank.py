"""Run under mpiexec by test_gpu_adasum.py: Adasum of device tensors through NCCLComm; results saved per rank."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ortflow.trainer.comm import DeviceBuffer, attach_nccl, create_communicator  # noqa: E402
from tests.trainer.adasum_rank import COUNTS, contribution  # noqa: E402


def main() -> None:
    import cupy

    out = Path(sys.argv[1])
    group = create_communicator(out / ".ranks", timeout_s=60)
    comm = attach_nccl(group, group.local_rank)
    flat = contribution("random", comm.rank, comm.size)
    tensors, offset = [], 0
    for count in COUNTS:
        tensors.append(cupy.asarray(flat[offset : offset + count]) if count else cupy.empty(0, cupy.float32))
        offset += count
    buffers = [DeviceBuffer(t.data.ptr, t.size, f"t{i}") for i, t in enumerate(tensors)]
    scalars = np.array([float(comm.rank + 1), 0.0], dtype=np.float32)
    comm.adasum_tensors(buffers, 2.0, scalars)  # divisor 2: each rank halves its contribution first
    result = np.concatenate([cupy.asnumpy(t) for t in tensors])
    np.save(out / f"gpu-rank{comm.rank}.npy", result)
    np.save(out / f"gpu-scalars{comm.rank}.npy", scalars)
    np.save(out / f"gpu-norm{comm.rank}.npy", np.array([comm.gradient_norm(buffers)]))
    comm.close()


if __name__ == "__main__":
    main()
