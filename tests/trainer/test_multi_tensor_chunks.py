"""The chunk table of the CUDA multi-tensor launches (comm/nccl.py TensorTable): every element of every tensor falls
in exactly one chunk, in tensor order, so the per-chunk partial sums add up to the whole in one fixed order; and its
buckets (the bucketed exchange, distributed.nccl_bucket_mb): consecutive chunk ranges whose packed range and tensor
pieces hold exactly their chunks' elements. Checked here by replaying the kernels' index arithmetic in numpy (the
kernels themselves run in tests/gpu)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from ortflow.trainer.comm.nccl import CHUNK, TensorTable

NUMPY_AS_CUPY = types.SimpleNamespace(asarray=np.asarray)


def _table(counts: list[int]) -> TensorTable:
    return TensorTable(NUMPY_AS_CUPY, tuple((1_000_000 * (i + 1), c) for i, c in enumerate(counts)))


def _chunk_elements(table: TensorTable, first: int, chunks: int) -> np.ndarray:
    """(tensor, element) rows, in order, that blocks 0 .. chunks - 1 of a launch from chunk ``first`` read
    (sum_squares, scale, pack, unpack: chunk c = first + blockIdx.x)."""
    ptrs, sizes, tensor, start, chunk = table.args
    covered = [np.empty((0, 2), np.int64)]
    for block in range(chunks):
        c = first + block
        t, lo = int(tensor[c]), int(start[c])
        elements = np.arange(lo, min(lo + int(chunk), int(sizes[t])))
        covered.append(np.stack([np.full(elements.size, t), elements], axis=1))
    return np.concatenate(covered)


def _all_elements(counts: list[int]) -> np.ndarray:
    """(tensor, element) rows of every element of tensors of ``counts`` elements, in tensor order."""
    return np.concatenate([np.empty((0, 2), np.int64)] + [np.stack([np.full(n, t), np.arange(n)], axis=1)
                                                          for t, n in enumerate(counts)])


def _replay(counts: list[int]) -> tuple[TensorTable, np.ndarray]:
    table = _table(counts)
    return table, _chunk_elements(table, 0, table.chunks)


def test_every_element_is_in_exactly_one_chunk_in_tensor_order():
    counts = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 0, 5]
    table, covered = _replay(counts)
    assert np.array_equal(covered, _all_elements(counts))
    assert table.chunks == 1 + 1 + 1 + 2 + 4 + 1 + 1  # an empty tensor keeps one (empty) chunk
    assert table.total == sum(counts)
    assert table.offsets.tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()


def test_a_large_model_gets_blocks_in_proportion_to_its_size_not_to_its_largest_tensor():
    counts = [6_291_456] + [768] * 150 + [2_359_296] * 12  # an embedding, many small vectors, the blocks' weights
    table = _table(counts)  # the chunk count only (test_every_element_is_in_exactly_one_chunk_in_tensor_order
    # replays the elements, on tensors small enough to list them)
    assert table.chunks == 384 + 150 + 12 * 144


COUNTS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 0, 5, 10 * CHUNK + 3, 2 * CHUNK]


@pytest.mark.parametrize("size", [0, 1, CHUNK, 2 * CHUNK + 5, 4 * CHUNK, 10**9])
def test_buckets_are_consecutive_chunk_ranges_whose_packed_range_and_pieces_hold_their_elements(size):
    table = _table(COUNTS)
    buckets = table.buckets(size)
    assert buckets[0].first == 0 and buckets[-1].first + buckets[-1].chunks == table.chunks
    assert all(a.first + a.chunks == b.first and a.hi == b.lo for a, b in zip(buckets, buckets[1:], strict=False))
    assert buckets[0].lo == 0 and buckets[-1].hi == table.total
    if size == 0 or size >= table.total:
        assert len(buckets) == 1
    else:  # a cut falls after the first chunk that reaches the next multiple of size
        assert all(b.hi - b.lo >= size for b in buckets[:-1])
        assert len(buckets) > 1 and all(b.hi - b.lo < size + CHUNK for b in buckets[:-1])
    base = {1_000_000 * (i + 1): i for i in range(len(COUNTS))}
    for bucket in buckets:
        elements = _chunk_elements(table, bucket.first, bucket.chunks)
        packed = np.asarray(table.offsets)[elements[:, 0]] + elements[:, 1]  # where the pack writes them
        assert np.array_equal(packed, np.arange(bucket.lo, bucket.hi))
        pieces = [np.empty((0, 2), np.int64)]  # what the per-tensor all-reduce of the bucket covers:
        for ptr, count in bucket.pieces:  # (device address - base) / 4 of tensor t
            t = max(b for b in base if b <= ptr)
            pieces.append(np.stack([np.full(count, base[t]), (ptr - t) // 4 + np.arange(count)], axis=1))
        assert np.array_equal(np.concatenate(pieces), elements)
