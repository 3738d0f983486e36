"""The chunk table of the CUDA multi-tensor launches (comm/nccl.py TensorTable): every element of every tensor falls
in exactly one chunk, in tensor order, so the per-chunk partial sums add up to the whole in one fixed order; checked
here by replaying the kernels' index arithmetic in numpy (the kernels themselves run in tests/gpu)."""

from __future__ import annotations

import types

import numpy as np

from ortflow.trainer.comm.nccl import CHUNK, TensorTable

NUMPY_AS_CUPY = types.SimpleNamespace(asarray=np.asarray)


def _replay(counts: list[int]) -> tuple[TensorTable, list[tuple[int, int]]]:
    table = TensorTable(NUMPY_AS_CUPY, tuple((1000 + i, c) for i, c in enumerate(counts)))
    ptrs, sizes, tensor, start, chunk = table.args
    covered = []
    for b in range(table.chunks):  # what block b of sum_squares / scale / pack / unpack reads
        t, first = int(tensor[b]), int(start[b])
        end = min(first + int(chunk), int(sizes[t]))
        covered.extend((t, i) for i in range(first, end))
    return table, covered


def test_every_element_is_in_exactly_one_chunk_in_tensor_order():
    counts = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 0, 5]
    table, covered = _replay(counts)
    assert covered == [(t, i) for t, n in enumerate(counts) for i in range(n)]
    assert table.chunks == 1 + 1 + 1 + 2 + 4 + 1 + 1  # an empty tensor keeps one (empty) chunk
    assert table.total == sum(counts)
    assert table.offsets.tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()


def test_a_large_model_gets_blocks_in_proportion_to_its_size_not_to_its_largest_tensor():
    counts = [6_291_456] + [768] * 150 + [2_359_296] * 12  # an embedding, many small vectors, the blocks' weights
    table, _ = _replay(counts)
    assert table.chunks == 384 + 150 + 12 * 144
