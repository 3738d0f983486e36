"""Rank-side reading of the shards: verification, the training loader and the eval loader.

Global sample cursor: sample ``g`` (counted over all ranks together) is row ``perm_e[g % N]`` of the training split,
with ``e = g // N`` its epoch and ``perm_e`` a permutation drawn by ``numpy.random.Generator(PCG64([seed, e]))``.
Batch ``k`` of rank ``r`` of ``W`` ranks, started at cursor ``c`` with per-rank batch ``B``, covers global samples
``[c + k*W*B + r*B, c + k*W*B + (r+1)*B)``. So the sample sequence does not depend on ``W`` and a checkpoint only
stores ``g``; batches run across epoch boundaries without a gap.

Shape rule: an input's rows have a fixed ``row_shape``; a batch stacks ``B`` rows to ``[B, *row_shape]``; when the
model declares one dim fewer (a GPT's ``labels`` ``[N]``, ``N = B*T``, for rows ``[T]``) the two leading dims are
merged to ``[B*row_shape[0], *row_shape[1:]]``. prepare_data checks this against the model before writing.

Shards are memory-mapped (``pa.memory_map`` + ``ipc.open_file``) and read as zero-copy numpy views; a batch is one
vectorised gather per record batch it touches, in the model's dtypes, C-contiguous.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ortflow.dataprep.errors import DataError
from ortflow.dataprep.manifest import FORMAT_VERSION, Manifest, read_manifest, sha256_file

log = logging.getLogger(__name__)

_FIX = "re-run prepare-data (`ortflow prepare-data CONFIG`)"


def _schema_problem(schema: pa.Schema, manifest: Manifest) -> str | None:
    """Why a shard's schema differs from the manifest's, or None."""
    version = (schema.metadata or {}).get(b"ortflow.format", b"?").decode()
    if version != str(FORMAT_VERSION):
        return f"shard format {version}, expected {FORMAT_VERSION}"
    got = [(f.name, str(f.type), json.loads((f.metadata or {}).get(b"row_shape", b"null"))) for f in schema]
    want = [(f["name"], f["type"], f["row_shape"]) for f in manifest.schema]
    if got != want:
        return f"schema {got} differs from the manifest's {want}"
    return None


def verify_data(data_dir: Path) -> Manifest:
    """Check the manifest and every shard: present, size, sha256, schema, row count and format version.

    Reads every byte once (sha256), so call it once, on rank 0, before training.

    Args:
        data_dir: the folder prepare_data wrote (``cfg.data_dir``).

    Returns:
        The manifest.

    Raises:
        DataError: naming the file, what is wrong, and to re-run prepare-data.
    """
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    for shards in manifest.splits.values():
        for shard in shards:
            path = data_dir / shard.file
            if not path.is_file():
                raise DataError(f"{path} is missing; {_FIX}")
            size = path.stat().st_size
            if size != shard.bytes:
                raise DataError(f"{path} has {size} bytes, the manifest says {shard.bytes} (truncated?); {_FIX}")
            if sha256_file(path) != shard.sha256:
                raise DataError(f"{path} does not match its sha256 in the manifest (altered or corrupted); {_FIX}")
            try:
                with pa.memory_map(str(path)) as mm:
                    reader = ipc.open_file(mm)
                    schema = reader.schema
                    rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            except (pa.ArrowInvalid, OSError) as err:
                raise DataError(f"{path} is not a readable Arrow file ({err}); {_FIX}") from None
            problem = _schema_problem(schema, manifest)
            if problem:
                raise DataError(f"{path}: {problem}; {_FIX}")
            if rows != shard.num_rows:
                raise DataError(f"{path} holds {rows} rows, the manifest says {shard.num_rows}; {_FIX}")
    return manifest


class _Split:
    """A split's shards as memory-mapped numpy views, one per input and record batch."""

    def __init__(self, data_dir: Path, manifest: Manifest, split: str):
        self.inputs = manifest.inputs
        self.views: dict[str, list[np.ndarray]] = {i.name: [] for i in self.inputs}
        starts = [0]
        for shard in manifest.splits[split]:
            path = Path(data_dir) / shard.file
            try:
                reader = ipc.open_file(pa.memory_map(str(path)))
            except (pa.ArrowInvalid, OSError) as err:
                raise DataError(f"{path} cannot be opened ({err}); {_FIX}") from None
            problem = _schema_problem(reader.schema, manifest)
            if problem:
                raise DataError(f"{path}: {problem}; {_FIX}")
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                for inp in self.inputs:
                    self.views[inp.name].append(_numpy_view(batch.column(inp.name), inp.row_shape, inp.dtype))
                starts.append(starts[-1] + batch.num_rows)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.num_rows = int(self.starts[-1])

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``rows`` of every input, shaped by the shape rule, C-contiguous, in the model's dtypes."""
        segment = np.searchsorted(self.starts, rows, side="right") - 1
        touched = np.flatnonzero(np.bincount(segment))  # sorted, as np.unique (which would import numpy.ma)
        feeds = {}
        for inp in self.inputs:
            views = self.views[inp.name]
            if len(touched) == 1:
                s = touched[0]
                out = np.take(views[s], rows - self.starts[s], axis=0)
            else:
                out = np.empty((len(rows), *inp.row_shape), dtype=views[0].dtype)
                for s in touched:  # one vectorised gather per record batch touched, never per sample
                    mask = segment == s
                    out[mask] = views[s][rows[mask] - self.starts[s]]
            if inp.merge_leading_dims:
                out = out.reshape(-1, *inp.row_shape[1:])
            feeds[inp.name] = np.ascontiguousarray(out)
        return feeds


def _numpy_view(column: pa.Array, row_shape: list[int], dtype: str) -> np.ndarray:
    """A zero-copy ``[rows, *row_shape]`` view of a shard column."""
    # A row is one fixed-size list; its values, sliced here (flatten() would import pyarrow.compute, a third of a second
    # per rank).
    width = column.type.list_size if row_shape else 1
    flat = column.values.slice(column.offset * width, len(column) * width) if row_shape else column
    values = flat.to_numpy(zero_copy_only=True).reshape(len(column), *row_shape)
    return values.view(np.bool_) if np.dtype(dtype) == np.bool_ else values


class TrainLoader:
    """This rank's training micro-batches, addressed by the global sample cursor (see the module docstring).

    Args:
        data_dir: the prepared data folder.
        batch_size: rows per micro-batch on this rank (B).
        rank: this rank (r), ``0 <= rank < world_size``.
        world_size: number of ranks (W).
        prefetch: batches prepared ahead by a background thread (0: none, batches are made on demand).
    """

    def __init__(self, data_dir: Path, batch_size: int, rank: int, world_size: int, prefetch: int = 2):
        _check_rank(batch_size, rank, world_size)
        manifest = read_manifest(Path(data_dir))
        self._split = _Split(Path(data_dir), manifest, "train")
        if self._split.num_rows == 0:
            raise DataError(f"{data_dir}: the train split is empty; {_FIX} with more data")
        self.batch_size, self.rank, self.world_size, self.prefetch = batch_size, rank, world_size, prefetch
        self.seed = manifest.seed
        self.num_samples: int = self._split.num_rows
        self.tokens_per_sample: int | None = manifest.tokens_per_sample
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        # The threads, not the iterators: a dropped iterator (its __del__ only asks its thread to stop) may leave a
        # thread still inside a batch read, and close() must join that one too before the rank exits.
        self._workers: list[_Worker] = []

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the training rows in ``epoch`` (the same on every rank and every run)."""
        with self._lock:  # the prefetch thread and the caller may both ask
            if epoch not in self._perms:
                if len(self._perms) >= 2:  # batches span at most two epochs unless B > N; keep memory flat
                    self._perms.pop(min(self._perms))
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._perms[epoch] = rng.permutation(self.num_samples)
            return self._perms[epoch]

    def rows_for(self, samples: np.ndarray) -> np.ndarray:
        """Training rows of global sample indices."""
        epochs, pos = np.divmod(samples, self.num_samples)
        rows = np.empty_like(samples)
        # One or two epochs per batch, in order (a range: np.unique imports numpy.ma, a tenth of a second per rank).
        for e in range(int(epochs.min()), int(epochs.max()) + 1) if samples.size else ():
            mask = epochs == e
            if mask.any():
                rows[mask] = self.permutation(e)[pos[mask]]
        return rows

    def batch(self, cursor: int, k: int) -> dict[str, np.ndarray]:
        """Batch ``k`` of this rank for a run started at global cursor ``cursor``."""
        first = cursor + k * self.world_size * self.batch_size + self.rank * self.batch_size
        return self._split.gather(self.rows_for(np.arange(first, first + self.batch_size, dtype=np.int64)))

    def iter_from(self, cursor: int) -> Iterator[dict[str, np.ndarray]]:
        """Endless iterator of this rank's micro-batches from global sample ``cursor``; ``close()`` it when done."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        produce = partial(self.batch, cursor)
        if self.prefetch <= 0:
            return _on_demand(produce)
        prefetcher = Prefetcher(produce, self.prefetch)
        self._workers = [w for w in self._workers if w.thread.is_alive()] + [prefetcher.worker]
        return prefetcher

    def close(self) -> None:
        """Stop and join every prefetch thread this loader started.

        A rank must do this before it exits: a daemon thread still reading a shard while the interpreter finalizes
        can abort the process (seen as a rare exit status 6, "terminate called without an active exception", of a
        rank that resumed a finished run and so returned at once, while its prefetch thread had just started). That
        includes the threads of iterators already dropped: the training loop's iterator is gone by the time the rank
        closes its loader, and a collected iterator only asks its thread to stop.
        """
        for worker in self._workers:
            worker.close()
        self._workers.clear()


def _on_demand(produce: Callable[[int], dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
    k = 0
    while True:
        yield produce(k)
        k += 1


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _fill(produce: Callable[[int], object], out: queue.Queue, stop: threading.Event) -> None:
    """The prefetch thread: make batches 0, 1, ... until stopped; an exception is handed over and ends it."""
    k = 0
    while not stop.is_set():
        try:
            item = produce(k)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            item = _Failure(err)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return
        k += 1


class _Worker:
    """A prefetch thread and its stop flag, without the iterator: what an owner joins before the process exits."""

    #: How long close() waits for a batch being made (a shard read on a loaded machine) before giving up with a warning.
    JOIN_TIMEOUT_S = 60.0

    def __init__(self, thread: threading.Thread, stop: threading.Event):
        self.thread, self.stop = thread, stop

    def close(self) -> None:
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                log.warning("a prefetch thread is still making a batch after %.0f s; exiting without it",
                            self.JOIN_TIMEOUT_S)


class Prefetcher:
    """Iterator over ``produce(0), produce(1), ...`` made ahead by a background thread in a bounded queue.

    The thread holds no reference to this object, so dropping the iterator (or ``close()``) stops it; an exception
    in the thread is raised by the next ``next()``. ``worker`` (the thread and its stop flag) lets an owner join the
    thread even after the iterator is gone.
    """

    def __init__(self, produce: Callable[[int], object], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_fill, args=(produce, self._queue, self._stop), daemon=True,
                                        name="ortflow-prefetch")
        self.worker = _Worker(self._thread, self._stop)
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and wait for it."""
        self.worker.close()

    @property
    def alive(self) -> bool:
        """Whether the background thread still runs."""
        return self._thread.is_alive()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()


class EvalLoader:
    """This rank's contiguous share of the eval split's batches (of its first ``max_rows`` rows), in order.

    The ``N`` rows evaluated form ``num_batches`` batches of ``batch_size`` rows (rows ``[k*B, (k+1)*B)``, the last one
    short); rank ``r`` of ``W`` takes batches ``[r*K//W, (r+1)*K//W)``. Every batch is the same on any number of ranks,
    so the engine computes the same float32 mean for it, and :func:`mean_eval_loss` adds the batches in one fixed rule:
    the eval loss of a checkpoint is one number on any layout and in ``ortflow evaluate``.

    When the model fixes its batch dim (an input's declared leading dim is an integer), every batch must have exactly
    ``batch_size`` rows: the short last batch is padded with copies of its first row, and :meth:`weighted_batches`
    says how to weight the losses so that every real row counts exactly once.

    Args:
        data_dir: the prepared data folder.
        batch_size: rows per batch (the same on every rank).
        rank: this rank.
        world_size: number of ranks.
        max_rows: evaluate only the split's first this many rows (``train.max_eval_rows``; None: all).
    """

    def __init__(self, data_dir: Path, batch_size: int, rank: int, world_size: int, max_rows: int | None = None):
        _check_rank(batch_size, rank, world_size)
        manifest = read_manifest(Path(data_dir))
        self._split = _Split(Path(data_dir), manifest, "eval")
        self._total = self._split.num_rows if max_rows is None else min(max_rows, self._split.num_rows)
        self.batch_size = batch_size
        #: Batches of the whole evaluation (every rank's), the length of :func:`mean_eval_loss`'s input.
        self.num_batches: int = -(-self._total // batch_size)
        self._first = rank * self.num_batches // world_size
        self._end = (rank + 1) * self.num_batches // world_size
        self.num_samples: int = min(self._end * batch_size, self._total) - min(self._first * batch_size, self._total)
        self.fixed_batch: bool = any(
            i.shape and isinstance(i.shape[0], int) and i.shape[0] > 0 for i in manifest.inputs
        )

    def _rows(self, max_batches: int | None) -> Iterator[tuple[int, np.ndarray]]:
        for k in range(self._first, self._end):
            if max_batches is not None and k - self._first >= max_batches:
                return
            start = k * self.batch_size
            yield k, np.arange(start, min(start + self.batch_size, self._total), dtype=np.int64)

    def batches(self, max_batches: int | None = None) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """Yield ``(feeds, real_rows)``; the last batch may be short, or padded to ``batch_size`` when fixed.

        Padded batches hold their ``real_rows`` real rows first, then copies of the first one.
        """
        for _, rows in self._rows(max_batches):
            real = len(rows)
            if self.fixed_batch and real < self.batch_size:
                rows = np.concatenate([rows, np.full(self.batch_size - real, rows[0], dtype=np.int64)])
            yield self._split.gather(rows), real

    def weighted_batches(self) -> Iterator[tuple[int, dict[str, np.ndarray], float, int]]:
        """Yield ``(batch, feeds, weight, real_rows)``: the sum of ``weight * mean batch loss`` over a batch index's
        items is the sum of its rows' losses (``batch``: the index into :func:`mean_eval_loss`'s input).

        A full batch has weight ``B``. A padded batch (``r`` real rows + ``B - r`` copies of its first row ``x0``)
        has weight ``B`` and is followed by a batch of ``B`` copies of ``x0`` with weight ``-(B - r)`` and 0 rows,
        under the same index: ``B * mean(pad) - (B - r) * loss(x0)`` is exactly the real rows' loss sum, for any loss
        that is a mean over rows of equal size (every loss the engine adds; also a model_output mean loss).
        """
        for k, rows in self._rows(None):
            real = len(rows)
            if not self.fixed_batch or real == self.batch_size:
                yield k, self._split.gather(rows), float(real), real
                continue
            pad = np.full(self.batch_size - real, rows[0], dtype=np.int64)
            yield k, self._split.gather(np.concatenate([rows, pad])), float(self.batch_size), real
            yield k, self._split.gather(np.full(self.batch_size, rows[0], dtype=np.int64)), -float(len(pad)), 0


def mean_eval_loss(batch_sums: np.ndarray) -> float | None:
    """The eval loss from every batch's ``[weighted loss sum, rows]`` (``num_batches x 2``, float64, in batch order;
    the training loop's ranks add theirs, zeros elsewhere, so each entry holds one rank's value exactly).

    The one rule for the recorded eval loss, ``ortflow evaluate`` and what export quotes: the mean loss per row, the
    batches' sums added exactly rounded (``math.fsum``), so the result does not depend on which rank held which
    batch or in what order the ranks' numbers arrived. None when no row was evaluated.
    """
    sums = np.asarray(batch_sums, dtype=np.float64).reshape(-1, 2)
    rows = math.fsum(sums[:, 1])
    return math.fsum(sums[:, 0]) / rows if rows else None


def _check_rank(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank} of {world_size}")
