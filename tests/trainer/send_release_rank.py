"""Run under ``mpiexec -n 2``: a rank holds only the send buffers still in flight, not every tensor it sent.

Rank 0 sends four 1 MiB tensors, one at a time, and after each waits for rank 1's reply (rank 1 replies once it has
the tensor, so the send is complete). Before release_sent, all four buffers stayed referenced until wait_sends.
"""

import tempfile
from pathlib import Path

import numpy as np

from ortflow.trainer.comm import MPIComm

comm = MPIComm(Path(tempfile.mkdtemp()) / "hb", 60.0)
size = 1 << 18  # float32 values: 1 MiB, above any eager-send threshold
held = []
for i in range(4):
    if comm.rank == 0:
        comm.send(np.full(size, i, np.float32), 1, 1)
        reply = comm.recv(1, 2, f"reply {i}")  # rank 1 has received tensor i
        assert reply[0] == i, reply
        held.append(comm.pending_send_bytes())
    else:
        got = comm.recv(0, 1, f"tensor {i}")
        assert got.shape == (size,) and got[0] == i
        comm.send(np.array([float(i)], np.float32), 0, 2)
comm.wait_sends("end")
assert comm.pending_send_bytes() == 0
if comm.rank == 0:
    # Each received tensor's buffer is dropped once its send is seen complete: at most the newest may still be held
    # (its completion not yet seen), never the four of them (4 MiB).
    assert max(held) <= 4 * size + 64, held
    print("held after each reply", held)
print("send release ok")
comm.close()
