"""Data preparation benchmark: shard writing vs pyarrow's own IPC write, loader batches/s, peak memory.

Run: ``python -m bench dataprep`` (writes bench/reports/dataprep.json; about a minute on 2 cores).

* write: ``prepare_data`` end to end (read parquet, check, two-pass shuffle, write shards, sha256, manifest) on a
  GPT-like table, in MB of shards per second, beside ``ipc.new_file`` writing the same in-memory table.
* loader: ``TrainLoader`` micro-batches per second (batch 8 x 128 tokens), with and without the prefetch thread.
  The trainer's step rate comes from the trainer's own bench; a 10.5M-param GPT at 8 x 128 per rank trains at
  ~1 step/s on a 2-core machine, for scale.
* memory: peak RSS (VmHWM, else ru_maxrss) of a fresh child process sharding a source several times
  data.memory_budget_mb, beside the same child's RSS after imports.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from bench.common import write_result
from ortflow.config import config_from_dict

RESULTS = Path(__file__).parent / "out" / "dataprep.json"
SEQ = 128
GPT_INPUTS = [{"name": "input_ids", "dtype": "int64", "shape": ["B", "T"]},
              {"name": "labels", "dtype": "int64", "shape": ["N"]}]  # fmt: skip


def _cfg(root: Path, train: Path, inputs: list[dict], run: str, **data):
    out = root / run
    out.mkdir(parents=True, exist_ok=True)
    (out / "configure.json").write_text(json.dumps({"train_inputs": inputs}))
    (root / "model.onnx").write_bytes(b"-")
    raw = {"output_dir": str(out), "model": {"path": str(root / "model.onnx")},
           "data": {"train": str(train), "eval_fraction": 0.0, **data},
           "train": {"batch_size": 8, "num_train_steps": 1}}  # fmt: skip
    return config_from_dict(raw)


def _gpt_table(rows: int) -> pa.Table:
    tokens = np.random.default_rng(0).integers(0, 256, (rows, SEQ + 1), dtype=np.int64)
    flat = lambda a: pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).reshape(-1)), SEQ)  # noqa: E731
    return pa.table({"input_ids": flat(tokens[:, :-1]), "labels": flat(tokens[:, 1:])})


def bench_write(root: Path, rows: int = 40_000) -> dict:
    from ortflow.dataprep import prepare_data

    table = _gpt_table(rows)
    pq.write_table(table, root / "gpt.parquet", compression="none")
    times = []
    for _ in range(5):  # one write of ~80 MB takes tens of ms and varies a lot with the page cache: take the median
        t0 = time.perf_counter()
        with ipc.new_file(str(root / "plain.arrow"), table.schema) as w:
            w.write_table(table)
        times.append(time.perf_counter() - t0)
    plain_s = float(np.median(times))
    plain_mb = (root / "plain.arrow").stat().st_size / 1e6
    cfg = _cfg(root, root / "gpt.parquet", GPT_INPUTS, "write", rows_per_shard=8192)
    t0 = time.perf_counter()
    manifest = prepare_data(cfg)
    ours_s = time.perf_counter() - t0
    ours_mb = manifest.num_bytes / 1e6
    return {
        "rows": rows, "shard_mb": round(ours_mb, 1),
        "prepare_data_mb_per_s": round(ours_mb / ours_s, 1), "pyarrow_ipc_write_mb_per_s": round(plain_mb / plain_s, 1),
        "ratio_prepare_over_pyarrow": round((ours_mb / ours_s) / (plain_mb / plain_s), 3),
        "note": "prepare_data also reads the parquet source, checks it, shuffles in two passes and hashes every shard",
    }, cfg.data_dir  # fmt: skip


def bench_loader(data_dir: Path, batches: int = 3000) -> dict:
    from ortflow.dataprep import TrainLoader

    out = {}
    for prefetch in (0, 2):
        for world, rank in ((1, 0), (2, 1)):
            it = TrainLoader(data_dir, 8, rank, world, prefetch=prefetch).iter_from(12_345)
            next(it)
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            rate = batches / (time.perf_counter() - t0)
            if prefetch:
                it.close()
            out[f"batches_per_s_prefetch{prefetch}_world{world}"] = round(rate, 1)
    out["batch"] = f"8 x {SEQ} tokens (int64 input_ids + merged labels)"
    out["trainer_step_rate_reference"] = (
        "~1 step/s (10.5M-param GPT, 8x128/rank); see the trainer bench"
    )
    return out


def _peak_rss_mb() -> float:
    """This process's RSS high-water mark in MB.

    Linux keeps ru_maxrss across fork and exec, so a child started from this (large) process would report the
    parent's peak; /proc's VmHWM belongs to the child's own address space. getrusage is the fallback elsewhere.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child_prepare(root: str, budget_mb: int, queue) -> None:
    from ortflow.dataprep import prepare_data

    base = _peak_rss_mb()
    cfg = _cfg(Path(root), Path(root) / "big.parquet", [{"name": "ids", "dtype": "int64", "shape": ["B"]},
               {"name": "x", "dtype": "float32", "shape": ["B", 64]}], f"mem{budget_mb}",  # fmt: skip
               memory_budget_mb=budget_mb, rows_per_shard=65536)
    t0 = time.perf_counter()
    manifest = prepare_data(cfg)
    queue.put({"budget_mb": budget_mb, "rss_after_imports_mb": round(base, 1),
               "peak_rss_mb": round(_peak_rss_mb(), 1),
               "arrow_pool_peak_mb": round(pa.default_memory_pool().max_memory() / 1e6, 1),
               "seconds": round(time.perf_counter() - t0, 1),
               "shard_mb": round(manifest.num_bytes / 1e6, 1)})  # fmt: skip


def bench_memory(root: Path, rows: int = 600_000) -> dict:
    ids = np.arange(rows, dtype=np.int64)
    x = np.random.default_rng(1).random((rows, 64), dtype=np.float32)
    table = pa.table({"ids": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 64)})
    pq.write_table(table, root / "big.parquet", compression="none", row_group_size=20_000)
    source_mb = table.nbytes / 1e6
    del table, x
    ctx = mp.get_context("spawn")  # a fresh interpreter: its high-water mark is this job's alone
    runs = []
    for budget in (32, 512):
        queue = ctx.Queue()
        proc = ctx.Process(target=_child_prepare, args=(str(root), budget, queue))
        proc.start()
        runs.append(queue.get())
        proc.join()
    return {"source_rows": rows, "source_mb_in_memory": round(source_mb, 1),
            "source_parquet_mb": round((root / "big.parquet").stat().st_size / 1e6, 1), "runs": runs}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run every part, print the results and write them (``bench/reports/dataprep.json`` and ``.md``)."""
    argparse.ArgumentParser(prog="python -m bench dataprep", description=__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write, data_dir = bench_write(root)
        results = {
            "command": "python -m bench dataprep",
            "write": write,
            "loader": bench_loader(data_dir),
            "memory": bench_memory(root),
        }
    text = json.dumps(results, indent=1)
    print(text)
    write_result(RESULTS.with_suffix(""), results, f"# Data preparation\n\n```json\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    main()
