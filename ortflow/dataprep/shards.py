"""Writing shards: a bounded-memory deterministic shuffle and fixed-size Arrow IPC files.

The shuffle is the classic two-pass one: pass 1 streams the source and sends each row to one of ``K`` temporary
bucket files chosen by a seeded generator; pass 2 reads one bucket at a time, permutes it with the same generator and
appends it to the shards. ``K`` is sized so one bucket fits in a quarter of the memory budget, so the source may be
far larger than memory, and the result is a uniformly random order that depends only on the data, the seed and
the settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ortflow.dataprep.manifest import FORMAT_VERSION, ShardInfo, sha256_file

#: IPC options of every shard: uncompressed, so that the loader can memory-map values without copying.
_WRITE_OPTIONS = ipc.IpcWriteOptions(compression=None)


def shard_schema(fields: list[pa.Field]) -> pa.Schema:
    """The schema of every shard: the inputs' fields plus the format version in the metadata."""
    return pa.schema(fields, metadata={"ortflow.format": str(FORMAT_VERSION)})


class ShardWriter:
    """Appends tables to ``<prefix>-00000.arrow, ...`` in ``folder``, ``rows_per_shard`` rows per file."""

    def __init__(self, folder: Path, prefix: str, schema: pa.Schema, rows_per_shard: int):
        self.folder, self.prefix, self.schema = Path(folder), prefix, schema
        self.rows_per_shard = rows_per_shard
        self.shards: list[ShardInfo] = []
        self._writer: ipc.RecordBatchFileWriter | None = None
        self._rows = 0

    def write(self, table: pa.Table) -> None:
        """Append rows, starting a new file whenever the current one is full."""
        start = 0
        while start < table.num_rows:
            if self._writer is None:
                path = self.folder / f"{self.prefix}-{len(self.shards):05d}.arrow"
                self._writer = ipc.new_file(str(path), self.schema, options=_WRITE_OPTIONS)
                self._rows = 0
            take = min(self.rows_per_shard - self._rows, table.num_rows - start)
            # few, large record batches: the loader gathers per record batch, so fewer means fewer numpy calls
            self._writer.write_table(table.slice(start, take).combine_chunks())
            self._rows += take
            start += take
            if self._rows == self.rows_per_shard:
                self._finish()

    def close(self) -> list[ShardInfo]:
        """Finish the last (possibly short) file and return every shard written."""
        if self._writer is not None:
            self._finish()
        return self.shards

    def _finish(self) -> None:
        self._writer.close()
        self._writer = None
        path = self.folder / f"{self.prefix}-{len(self.shards):05d}.arrow"
        self.shards.append(ShardInfo(path.name, self._rows, path.stat().st_size, sha256_file(path)))


def num_buckets(estimated_bytes: int, memory_budget_bytes: int) -> int:
    """Buckets needed so that one holds about a quarter of the memory budget."""
    return max(1, math.ceil(estimated_bytes / max(1, memory_budget_bytes // 4)))


def shuffle_into(
    tables: Iterable[pa.Table],
    schema: pa.Schema,
    tmp_dir: Path,
    buckets: int,
    seed: int,
    writers: list[tuple[ShardWriter, int | None]],
    eval_fraction: float = 0.0,
) -> int:
    """Shuffle the rows of ``tables`` through ``buckets`` temporary files and write them to ``writers``.

    Args:
        tables: canonical tables (schema ``schema``), streamed.
        schema: the shard schema.
        tmp_dir: folder for bucket files (deleted by the caller).
        buckets: number of bucket files.
        seed: shuffle seed.
        writers: (writer, rows) pairs filled in order; rows None takes the rest. The eval writer comes first with
            rows None here and its count is decided from ``eval_fraction`` once the total is known.
        eval_fraction: share of rows that go to the first writer when its rows is None and a second writer exists.

    Returns:
        The number of rows shuffled.
    """
    rng = np.random.Generator(np.random.PCG64([seed, 0x5EED]))
    bucket_writers = [ipc.new_file(str(tmp_dir / f"bucket-{b:05d}.arrow"), schema, options=_WRITE_OPTIONS)
                      for b in range(buckets)]  # fmt: skip
    total = 0
    try:
        for table in tables:
            if buckets == 1:
                bucket_writers[0].write_table(table)
            else:
                ids = rng.integers(0, buckets, table.num_rows)
                order = np.argsort(ids, kind="stable")
                bounds = np.searchsorted(ids[order], np.arange(buckets + 1))
                grouped = table.take(pa.array(order))
                for b in np.flatnonzero(np.diff(bounds)):
                    bucket_writers[b].write_table(grouped.slice(bounds[b], bounds[b + 1] - bounds[b]))
            total += table.num_rows
    finally:
        for w in bucket_writers:
            w.close()

    quotas = [rows for _, rows in writers]
    if len(writers) > 1 and quotas[0] is None:
        quotas[0] = round(total * eval_fraction)
    current, left = 0, quotas[0]
    for b in range(buckets):
        with pa.memory_map(str(tmp_dir / f"bucket-{b:05d}.arrow")) as mm:
            table = ipc.open_file(mm).read_all()
            # take copies the rows out of the mapping, so the table outlives the closed file
            table = table.take(pa.array(rng.permutation(table.num_rows))).combine_chunks()
        start = 0
        while start < table.num_rows:
            while left == 0:
                current += 1
                left = quotas[current]
            take = table.num_rows - start if left is None else min(left, table.num_rows - start)
            writers[current][0].write(table.slice(start, take))
            start += take
            left = None if left is None else left - take
        del table
        (tmp_dir / f"bucket-{b:05d}.arrow").unlink()
    return total
