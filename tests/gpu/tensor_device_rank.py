"""Test-only rank entry: a tensor-parallel CUDA rank's micro-batches, watching where its pieces' tensors live.

Usage: mpiexec -n 2 python tensor_device_rank.py RUN_DIR (an hp 2 run on CUDA). Every engine call of the rank's pieces
is recorded with the devices where the engine wrote its outputs, and so are the sent tensors of the pieces that keep
their activations (the engine's separate calls on the rank's stream). After three micro-batches the rank sums random
tensors of its own over the tensor-parallel group (a small one, an 8 MiB one for NCCL's bulk protocols, and the small
one in place, as a replicated parameter's gradient buffer), adds two tensors and halves one on the GPU, and prints one
``RESULT`` line: the devices per micro-batch, and whether the sums, the add and the product have the bits of the
host's rank-order float32 adds and float32 product.
"""

import json
import sys
from pathlib import Path

import numpy as np

import ortflow.trainer.parallel.activations as activations
from ortflow.dataprep.loader import TrainLoader
from ortflow.trainer.comm.nccl import DeviceBuffer
from ortflow.trainer.runtime import init_runtime, start_mpi

run_dir = Path(sys.argv[1])
cfg, comm = start_mpi(run_dir)
rt = init_runtime(run_dir, cfg, comm).body  # the rank's tensor-parallel pieces
tensors, devices = rt.tensors, []
engine_call = activations.call_module


def call_module(module, train, inputs, outputs):
    """The engine call as the rank makes it; records where the engine put the outputs."""
    results = engine_call(module, train, inputs, outputs)
    devices[-1].update(r.device_name() for r in results)
    return results


activations.call_module = call_module
kept_devices: set[str] = set()  # where the pieces that keep their activations leave their sent tensors


def watch_kept(kept):
    forward = kept.forward

    def watched(feeds):
        outputs = forward(feeds)
        kept_devices.update(o.device_name() for o in outputs)
        return outputs

    kept.forward = watched


for piece in rt.pieces:
    if piece.kept is not None:
        watch_kept(piece.kept)
shard, shards = comm.rank // rt.tp_size, comm.size // rt.tp_size  # a replica's tp ranks read its batches
batches = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=0).iter_from(0)
for _ in range(3):
    devices.append(set())
    rt.micro_step(next(batches))

rng = np.random.default_rng(100 + rt.tp_rank)
mine = (rng.normal(size=(3, 5, 7)) * 10.0 ** rng.integers(-8, 8, (3, 5, 7))).astype(np.float32)
every = rt.tp_comm.gather_object(mine, "test parts")
every = rt.tp_comm.broadcast(every, "test parts")
expected = every[0].copy()
for part in every[1:]:
    expected += part
total = tensors.sum(tensors.to_device(mine), "test sum")
# Large enough for NCCL's bulk protocols (a small sum goes through its low-latency one)
big = (rng.normal(size=(2, 1 << 20)) * 10.0 ** rng.integers(-8, 8, (2, 1 << 20))).astype(np.float32)
bigs = rt.tp_comm.broadcast(rt.tp_comm.gather_object(big, "test parts"), "test parts")
big_expected = bigs[0].copy()
for part in bigs[1:]:
    big_expected += part
big_total = tensors.sum(tensors.to_device(big), "test large sum")
added = tensors.add(tensors.to_device(every[0]), tensors.to_device(every[1]))
halved = tensors.scale(tensors.to_device(mine), 0.5)  # a replicated send's arriving gradient at tp 2
buffer = tensors.to_device(mine)  # an engine gradient buffer summed in place (a replicated parameter's)
tensors.sum_into([DeviceBuffer(buffer.data_ptr(), mine.size, "test buffer")], "test sum into")
print("RESULT " + json.dumps({
    "rank": comm.rank, "devices": [sorted(d) for d in devices], "sum_device": total.device_name(),
    "kept_pieces": sum(p.kept is not None for p in rt.pieces), "kept_devices": sorted(kept_devices),
    "sum_bits_equal": tensors.host(total).tobytes() == expected.tobytes(),
    "large_sum_bits_equal": tensors.host(big_total).tobytes() == big_expected.tobytes(),
    "add_bits_equal": tensors.host(added).tobytes() == (every[0] + every[1]).tobytes(),
    "scale_bits_equal": tensors.host(halved).tobytes() == (mine * np.float32(0.5)).tobytes(),
    "sum_into_bits_equal": tensors.host(buffer).tobytes() == expected.tobytes(),
}), flush=True)
comm.barrier("test done")
comm.close()
