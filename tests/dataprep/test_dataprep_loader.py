"""The cursor-addressed training loader, the eval loader and the prefetch thread."""

from __future__ import annotations

import gc
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
from dataprep_helpers import check_rows, make_cfg, write_parquet

from ortflow.dataprep import EvalLoader, TrainLoader, prepare_data
from ortflow.dataprep.loader import Prefetcher, mean_eval_loss


@pytest.fixture
def data_dir(tmp_path):
    """25 train rows (not a multiple of any batch) in shards of 4 rows, and 11 eval rows."""
    write_parquet(tmp_path / "train.parquet", 25)
    write_parquet(tmp_path / "test.parquet", 11, start=100)
    cfg = make_cfg(tmp_path, [str(tmp_path / "train.parquet")], test=[str(tmp_path / "test.parquet")], rows_per_shard=4)
    prepare_data(cfg)
    return cfg.data_dir


def global_sequence(data_dir, world_size: int, batch: int, steps: int, cursor: int = 0) -> list[int]:
    """Sample ids in global order: step k's batches of ranks 0..W-1, side by side (ranks simulated in one process)."""
    its = [TrainLoader(data_dir, batch, r, world_size, prefetch=1).iter_from(cursor) for r in range(world_size)]
    seq = []
    for _ in range(steps):
        for it in its:
            feeds = next(it)
            check_rows(feeds)
            seq.extend(feeds["ids"].tolist())
    for it in its:
        it.close()
    return seq


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sample_once_per_epoch(data_dir, world_size):
    n, batch = 25, 2
    steps = -(-3 * n // (world_size * batch))  # three epochs, crossing boundaries mid-batch
    seq = global_sequence(data_dir, world_size, batch, steps)
    epochs = [seq[e * n : (e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]  # each epoch is reshuffled


def test_sequence_does_not_depend_on_world_size(data_dir):
    one = global_sequence(data_dir, 1, 2, 30)
    assert global_sequence(data_dir, 2, 2, 15) == one
    assert global_sequence(data_dir, 3, 2, 10) == one


def test_resume_with_other_world_size_continues_sequence(data_dir):
    reference = global_sequence(data_dir, 1, 3, 24)  # 72 samples
    first = global_sequence(data_dir, 2, 3, 5)  # 30 samples, then a "checkpoint" at cursor 30
    rest = global_sequence(data_dir, 3, 3, 4, cursor=30)  # 36 samples on 3 ranks
    assert first + rest == reference[:66]


def test_permutation_depends_on_seed_and_epoch(tmp_path):
    write_parquet(tmp_path / "t.parquet", 40)
    orders = []
    for seed in (0, 1):
        cfg = make_cfg(tmp_path, [str(tmp_path / "t.parquet")], run=f"run{seed}", seed=seed)
        prepare_data(cfg)
        loader = TrainLoader(cfg.data_dir, 1, 0, 1)
        orders.append((loader.permutation(0).tolist(), loader.permutation(1).tolist()))
    assert orders[0][0] != orders[0][1] and orders[0] != orders[1]
    again = TrainLoader(cfg.data_dir, 1, 0, 1)
    assert (again.permutation(0).tolist(), again.permutation(1).tolist()) == orders[1]


def test_batches_have_model_dtypes_and_contiguous_arrays(data_dir):
    loader = TrainLoader(data_dir, 4, 0, 1, prefetch=0)
    assert loader.num_samples == 25 and loader.tokens_per_sample is None
    feeds = next(loader.iter_from(7))
    assert {k: (v.dtype, v.shape) for k, v in feeds.items()} == {
        "ids": (np.int64, (4,)), "x": (np.float32, (4, 3)), "labels": (np.int64, (4,)),
    }  # fmt: skip
    assert all(v.flags.c_contiguous for v in feeds.values())


def test_prefetch_gives_same_batches_as_on_demand(data_dir):
    a = TrainLoader(data_dir, 3, 1, 2, prefetch=3).iter_from(5)
    b = TrainLoader(data_dir, 3, 1, 2, prefetch=0).iter_from(5)
    for _ in range(12):
        fa, fb = next(a), next(b)
        assert all(np.array_equal(fa[k], fb[k]) for k in fa)
    a.close()


def test_prefetch_thread_stops_on_close_and_on_garbage_collection(data_dir):
    it = TrainLoader(data_dir, 2, 0, 1, prefetch=2).iter_from(0)
    next(it)
    it.close()
    assert not it.alive
    with pytest.raises(StopIteration):
        next(it)
    it = TrainLoader(data_dir, 2, 0, 1, prefetch=2).iter_from(0)
    next(it)
    thread = it._thread
    del it
    gc.collect()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_prefetch_propagates_exceptions():
    def produce(k):
        if k == 3:
            raise RuntimeError("shard vanished")
        return k

    it = Prefetcher(produce, 2)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="shard vanished"):
        next(it)
    time.sleep(0.01)
    assert not it.alive


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_shares_are_disjoint_ordered_and_complete(data_dir, world_size):
    seen, counts = [], []
    for rank in range(world_size):
        loader = EvalLoader(data_dir, 2, rank, world_size)
        rows = 0
        for feeds, real in loader.batches():
            assert len(feeds["ids"]) == real <= 2
            check_rows(feeds)
            seen.extend(feeds["ids"].tolist())
            rows += real
        counts.append(rows)
        assert rows == loader.num_samples
    assert seen == list(range(100, 111))  # ranks' shares in order, disjoint, covering the split
    assert max(counts) - min(counts) <= 2  # whole batches: the shares differ by at most one batch


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_eval_batches_are_the_same_on_any_number_of_ranks(data_dir, world_size):
    def batches(world_size):
        found = {}
        for rank in range(world_size):
            loader = EvalLoader(data_dir, 2, rank, world_size)
            assert loader.num_batches == 6  # 11 rows in batches of 2: the whole evaluation's, on every rank
            for k, feeds, weight, real in loader.weighted_batches():
                assert k not in found and weight == real == len(feeds["ids"])
                found[k] = feeds["ids"].tolist()
        return found

    alone = batches(1)
    assert alone == {k: list(range(100 + 2 * k, min(102 + 2 * k, 111))) for k in range(6)}
    assert batches(world_size) == alone  # the same rows in the same batch, under the same index


def test_mean_eval_loss_adds_the_batches_exactly_rounded_in_any_order():
    rng = np.random.default_rng(0)
    losses = rng.uniform(0.5, 9.0, size=1000).astype(np.float32).astype(np.float64)
    sums = np.stack([losses * 3, np.full(1000, 3.0)], axis=1)
    loss = mean_eval_loss(sums)
    assert loss == mean_eval_loss(sums[::-1]) == mean_eval_loss(sums[rng.permutation(1000)])
    assert loss == float(sum(Fraction(x) for x in sums[:, 0])) / 3000  # the exact sum rounded once, per row
    assert mean_eval_loss(np.zeros((0, 2))) is None


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_max_eval_rows_selects_the_same_global_rows_on_any_layout(data_dir, world_size):
    seen = []
    for rank in range(world_size):
        for feeds, real in EvalLoader(data_dir, 2, rank, world_size, max_rows=5).batches():
            seen.extend(feeds["ids"][:real].tolist())
    assert seen == list(range(100, 105))  # the split's first 5 rows, whatever the number of ranks


def test_eval_max_batches_and_empty_split(tmp_path, data_dir):
    assert len(list(EvalLoader(data_dir, 2, 0, 1).batches(max_batches=3))) == 3
    write_parquet(tmp_path / "only.parquet", 6)
    cfg = make_cfg(tmp_path, [str(tmp_path / "only.parquet")], run="noeval", eval_fraction=0.0)
    prepare_data(cfg)
    loader = EvalLoader(cfg.data_dir, 2, 0, 1)
    assert loader.num_samples == 0 and list(loader.batches()) == []


def test_bad_rank_is_refused(data_dir):
    with pytest.raises(ValueError, match="rank 2 of 2"):
        TrainLoader(data_dir, 2, 2, 2)


def test_loader_close_joins_every_prefetch_thread_it_started(data_dir):
    # A rank closes its loader before it exits: a prefetch thread still reading while the interpreter finalizes can
    # abort the process (a rank resuming a finished run returns at once, right after its prefetch thread started).
    loader = TrainLoader(data_dir, 2, 0, 1, prefetch=2)
    its = [loader.iter_from(0), loader.iter_from(4)]  # never consumed, like the resume of a finished run
    next(its[1])
    assert all(it.alive for it in its)
    loader.close()
    assert not any(it.alive for it in its)
    loader.close()  # idempotent


def test_loader_close_joins_the_thread_of_an_iterator_already_dropped(data_dir):
    # The training loop's iterator is gone by the time a rank closes its loader: when the run had nothing left to do
    # (a resume of a finished run), its thread may still be inside its first batch read. Dropping the iterator only
    # asks the thread to stop; close() must still wait for it, or the interpreter finalizes under a native read (the
    # rare "terminate called without an active exception" of tests/faults' concurrent-runs trial).
    loader = TrainLoader(data_dir, 2, 0, 1, prefetch=2)
    entered, release = threading.Event(), threading.Event()
    read = loader.batch

    def slow_batch(cursor, k):
        entered.set()
        release.wait(timeout=30)  # a batch read that takes a while (a loaded machine)
        return read(cursor, k)

    loader.batch = slow_batch
    before = set(threading.enumerate())
    it = loader.iter_from(0)
    (thread,) = set(threading.enumerate()) - before
    assert entered.wait(timeout=10)
    del it
    gc.collect()
    assert thread.is_alive()  # dropped, but still inside the read
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(timeout=0.5)
    assert closer.is_alive() and thread.is_alive()  # close() waits for the read ...
    release.set()
    closer.join(timeout=30)
    assert not closer.is_alive() and not thread.is_alive()  # ... and returns only once the thread has ended
