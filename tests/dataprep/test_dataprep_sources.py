"""Each source kind round-trips through prepare_data and the loaders."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pytest
from dataprep_helpers import TABLE_INPUTS, check_rows, make_cfg, table_rows, write_parquet

from ortflow.dataprep import EvalLoader, TrainLoader, prepare_data


def _all_train_rows(cfg, batch_size=1) -> dict[str, np.ndarray]:
    """One epoch of the train split in loader order (world size 1)."""
    loader = TrainLoader(cfg.data_dir, batch_size, 0, 1, prefetch=0)
    it = loader.iter_from(0)
    batches = [next(it) for _ in range(loader.num_samples // batch_size)]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _write(kind: str, path, table: pa.Table) -> None:
    if kind == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif kind == "arrow":
        with ipc.new_file(str(path), table.schema) as w:
            w.write_table(table, max_chunksize=7)
    elif kind == "feather":
        feather.write_feather(table, path, compression="zstd")  # compressed: the sharder must still read it
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    elif kind == "npz":
        np.savez(path, ids=table["ids"].to_numpy(), labels=table["labels"].to_numpy(),
                 x=np.stack(table["x"].to_numpy(zero_copy_only=False)))  # fmt: skip


@pytest.mark.parametrize("kind", ["parquet", "arrow", "feather", "jsonl", "npz"])
def test_table_sources_round_trip(tmp_path, kind):
    suffix = {"arrow": ".arrow", "feather": ".feather", "jsonl": ".jsonl", "npz": ".npz", "parquet": ".parquet"}[kind]
    # two files, so that rows from several files and several chunks meet in the shards
    paths = [tmp_path / f"part{i}{suffix}" for i in range(2)]
    _write(kind, paths[0], table_rows(13))
    _write(kind, paths[1], table_rows(9, start=13))
    cfg = make_cfg(tmp_path, [str(tmp_path / f"part*{suffix}")], rows_per_shard=5)
    manifest = prepare_data(cfg)
    assert manifest.num_rows("train") == 22 and len(manifest.splits["train"]) == 5
    rows = _all_train_rows(cfg)
    assert sorted(rows["ids"]) == list(range(22))
    check_rows(rows)
    assert rows["x"].dtype == np.float32 and rows["ids"].dtype == np.int64


def test_csv_round_trip_with_column_mapping(tmp_path):
    ids = np.arange(17)
    pcsv.write_csv(pa.table({"row_id": ids, "feature": ids * 0.5, "y": ids % 3}), tmp_path / "d.csv")
    inputs = [{"name": "ids", "dtype": "int64", "shape": ["B"]}, {"name": "x", "dtype": "float32", "shape": ["B"]},
              {"name": "labels", "dtype": "int32", "shape": ["B"]}]  # fmt: skip
    mapping = {"ids": "row_id", "x": "feature", "labels": "y"}
    cfg = make_cfg(tmp_path, [str(tmp_path / "d.csv")], inputs=inputs, columns=mapping)
    prepare_data(cfg)
    rows = _all_train_rows(cfg)
    order = np.argsort(rows["ids"])
    np.testing.assert_array_equal(rows["ids"][order], ids)
    np.testing.assert_array_equal(rows["x"][order], (ids * 0.5).astype(np.float32))
    assert rows["labels"].dtype == np.int32
    np.testing.assert_array_equal(rows["labels"][order], ids % 3)


GPT_INPUTS = [{"name": "input_ids", "dtype": "int64", "shape": ["B", "T"]},
              {"name": "labels", "dtype": "int64", "shape": ["N"]}]  # fmt: skip


def test_text_round_trip_byte_windows_and_merged_labels(tmp_path):
    corpus = bytes(range(256)) * 3 + b"tail"
    (tmp_path / "a.txt").write_bytes(corpus[:500])
    (tmp_path / "b.txt").write_bytes(corpus[500:])
    seq = 8
    cfg = make_cfg(tmp_path, [str(tmp_path / "*.txt")], inputs=GPT_INPUTS, text={"seq_len": seq}, batch_size=3)
    manifest = prepare_data(cfg)
    n_windows = len(corpus) // (seq + 1)  # the files are one token stream; the short tail is dropped
    assert manifest.num_rows("train") == n_windows and manifest.tokens_per_sample == seq
    loader = TrainLoader(cfg.data_dir, 3, 0, 1, prefetch=0)
    assert loader.tokens_per_sample == seq
    batch = next(loader.iter_from(0))
    assert batch["input_ids"].shape == (3, seq) and batch["labels"].shape == (3 * seq,)  # the shape rule's merge
    assert batch["labels"].flags.c_contiguous
    np.testing.assert_array_equal(batch["labels"].reshape(3, seq)[:, :-1], batch["input_ids"][:, 1:])
    # one epoch holds every window exactly once, labels shifted by one token
    windows = np.frombuffer(corpus, np.uint8)[: n_windows * (seq + 1)].reshape(n_windows, seq + 1).astype(np.int64)
    epoch = next(TrainLoader(cfg.data_dir, n_windows, 0, 1, prefetch=0).iter_from(0))
    got = np.concatenate([epoch["input_ids"], epoch["labels"].reshape(n_windows, seq)[:, -1:]], axis=1)
    np.testing.assert_array_equal(got[np.lexsort(got.T[::-1])], windows[np.lexsort(windows.T[::-1])])


def test_separate_test_files_become_the_eval_split(tmp_path):
    write_parquet(tmp_path / "train.parquet", 20)
    write_parquet(tmp_path / "test.parquet", 7, start=100)
    cfg = make_cfg(tmp_path, [str(tmp_path / "train.parquet")], test=[str(tmp_path / "test.parquet")])
    manifest = prepare_data(cfg)
    assert (manifest.num_rows("train"), manifest.num_rows("eval")) == (20, 7)
    ids = [f["ids"] for f, _ in EvalLoader(cfg.data_dir, 3, 0, 1).batches()]
    np.testing.assert_array_equal(np.concatenate(ids), np.arange(100, 107))  # eval keeps the file's order


def test_eval_fraction_holds_out_disjoint_rows(tmp_path, parquet_source):
    cfg = make_cfg(tmp_path, [str(parquet_source)], eval_fraction=0.2)
    manifest = prepare_data(cfg)
    assert (manifest.num_rows("train"), manifest.num_rows("eval")) == (24, 6)
    train = set(_all_train_rows(cfg)["ids"].tolist())
    held = set(np.concatenate([f["ids"] for f, _ in EvalLoader(cfg.data_dir, 4, 0, 1).batches()]).tolist())
    assert not train & held and train | held == set(range(30))
    assert held != set(range(24, 30))  # held-out rows are drawn at random, not the file's tail


def test_column_inputs_keep_table_input_order(tmp_path, parquet_source):
    manifest = prepare_data(make_cfg(tmp_path, [str(parquet_source)]))
    assert [i.name for i in manifest.inputs] == [i["name"] for i in TABLE_INPUTS]
