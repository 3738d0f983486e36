"""prepare_data: determinism, the bounded-memory shuffle, re-runs, and checks before any file is written."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataprep_helpers import TABLE_INPUTS, check_rows, make_cfg, write_parquet

from ortflow.dataprep import DataError, EvalLoader, TrainLoader, prepare_data


def _shard_bytes(data_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.glob("*.arrow"))}


def test_same_seed_gives_identical_shards(tmp_path, parquet_source):
    dirs = []
    for run in ("a", "b", "c"):
        cfg = make_cfg(tmp_path, [str(parquet_source)], run=run, seed=7 if run != "c" else 8, rows_per_shard=8,
                       eval_fraction=0.2)  # fmt: skip
        prepare_data(cfg)
        dirs.append(cfg.data_dir)
    a, b, c = (_shard_bytes(d) for d in dirs)
    assert a == b and len(a) == 3 + 1  # 24 train rows in shards of 8, 6 eval rows
    assert (dirs[0] / "manifest.json").read_text() == (dirs[1] / "manifest.json").read_text()
    assert a != c  # another seed shuffles differently


def test_source_larger_than_budget_is_shuffled_through_buckets(tmp_path):
    # ~2.4 MB of rows with a 1 MB budget: 10 buckets, so the streaming two-pass shuffle really runs
    n = 60_000
    write_parquet(tmp_path / "big.parquet", n)
    cfgs = [make_cfg(tmp_path, [str(tmp_path / "big.parquet")], run=r, memory_budget_mb=1, rows_per_shard=16384,
                     eval_fraction=0.1) for r in ("a", "b")]  # fmt: skip
    manifest = prepare_data(cfgs[0])
    prepare_data(cfgs[1])
    assert _shard_bytes(cfgs[0].data_dir) == _shard_bytes(cfgs[1].data_dir)
    assert (manifest.num_rows("train"), manifest.num_rows("eval")) == (54_000, 6_000)
    train = next(TrainLoader(cfgs[0].data_dir, 54_000, 0, 1, prefetch=0).iter_from(0))
    held = next(EvalLoader(cfgs[0].data_dir, 6_000, 0, 1).batches())[0]
    check_rows(train)
    assert sorted(np.concatenate([train["ids"], held["ids"]]).tolist()) == list(range(n))
    # the shard order itself is shuffled: the first shard is not a run of neighbouring source rows
    first = pa.ipc.open_file(cfgs[0].data_dir / "train-00000.arrow").read_all()["ids"].to_numpy()
    assert np.abs(np.diff(first)).mean() > 1000
    assert not (cfgs[0].data_dir / ".staging").exists()


def test_unchanged_rerun_is_a_noop(tmp_path, parquet_source, caplog):
    cfg = make_cfg(tmp_path, [str(parquet_source)], rows_per_shard=8)
    first = prepare_data(cfg)
    assert not first.reused
    stamps = {p.name: p.stat().st_mtime_ns for p in cfg.data_dir.iterdir()}
    with caplog.at_level(logging.INFO, logger="ortflow.dataprep"):
        second = prepare_data(cfg)
    assert second.reused and second == first
    assert "nothing to do" in caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in cfg.data_dir.iterdir()} == stamps


def test_changed_source_or_settings_or_damaged_shard_rewrites(tmp_path, parquet_source):
    cfg = make_cfg(tmp_path, [str(parquet_source)], rows_per_shard=8)
    prepare_data(cfg)
    write_parquet(parquet_source, 31)  # new content
    again = prepare_data(cfg)
    assert not again.reused and again.num_rows("train") == 31
    fewer = make_cfg(tmp_path, [str(parquet_source)], rows_per_shard=10)
    assert not prepare_data(fewer).reused
    assert sorted(p.name for p in fewer.data_dir.glob("train-*.arrow")) == [f"train-0000{i}.arrow" for i in range(4)]
    shard = fewer.data_dir / "train-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-10])
    repaired = prepare_data(fewer)
    assert not repaired.reused and repaired.splits["train"][1].bytes == shard.stat().st_size


def test_missing_configure_json_says_run_configure(tmp_path, parquet_source):
    cfg = make_cfg(tmp_path, [str(parquet_source)])
    (cfg.output_dir / "configure.json").unlink()
    with pytest.raises(DataError, match="run configure first"):
        prepare_data(cfg)


def _inputs_with(name, **change):
    return [dict(i, **change) if i["name"] == name else i for i in TABLE_INPUTS]


@pytest.mark.parametrize(
    ("inputs", "columns", "message"),
    [
        # (whole-number floats feed int inputs losslessly, so x's [3] rows must clash with labels' fixed dim instead)
        (_inputs_with("labels", dtype="int64", shape=["B", 2]), {"labels": "x"}, "column 'x'.*model input 'labels'"),
        (_inputs_with("ids", dtype="int32", shape=["B", 4]), {}, r"column 'ids': rows have shape \[\].*2 dims"),
        (_inputs_with("x", shape=["B", 4]), {}, r"column 'x'.*fixed at \['B', 4\]"),
        (_inputs_with("x", shape=["B", 3, 1]), {}, r"column 'x': rows have shape \[3\].*3 dims"),
        (_inputs_with("labels", dtype="float32", shape=["B", 3]), {"labels": "f"}, "column 'f'"),
    ],
)
def test_bad_dtype_or_shape_names_the_column_before_writing(tmp_path, inputs, columns, message):
    table = pq.read_table(write_parquet(tmp_path / "t.parquet", 10)).append_column("f", pa.array(["a"] * 10))
    pq.write_table(table, tmp_path / "t.parquet")
    cfg = make_cfg(tmp_path, [str(tmp_path / "t.parquet")], inputs=inputs, columns=columns)
    with pytest.raises(DataError, match=message):
        prepare_data(cfg)
    assert not cfg.data_dir.exists()


def test_float_column_feeds_integer_input_only_without_losing_information(tmp_path):
    pq.write_table(pa.table({"ids": [0.0, 1.0, 2.5, 3.0], "x": [[0.0] * 3] * 4, "labels": np.arange(4)}),
                   tmp_path / "f.pq")  # fmt: skip
    cfg = make_cfg(tmp_path, [str(tmp_path / "f.pq")])
    with pytest.raises(DataError, match="column 'ids'.*int64 without losing information.*2.5"):
        prepare_data(cfg)
    assert not cfg.data_dir.exists()
    # Whole numbers written as floats (a CSV's "1.0") lose nothing: they are cast.
    pq.write_table(pa.table({"ids": np.arange(4.0), "x": [[0.0] * 3] * 4, "labels": np.arange(4)}), tmp_path / "f.pq")
    prepare_data(cfg)
    held = next(TrainLoader(cfg.data_dir, 4, 0, 1).iter_from(0))["ids"]
    assert held.dtype == np.int64 and sorted(held.tolist()) == [0, 1, 2, 3]


def test_ragged_lists_and_missing_columns_are_named(tmp_path):
    pq.write_table(pa.table({"ids": [0, 1], "x": [[0.0, 1.0, 2.0], [1.0]], "labels": [0, 1]}), tmp_path / "r.pq")
    with pytest.raises(DataError, match="column 'x'.*different lengths"):
        prepare_data(make_cfg(tmp_path, [str(tmp_path / "r.pq")]))
    pq.write_table(pa.table({"ids": [0, 1], "labels": [0, 1]}), tmp_path / "m.pq")
    with pytest.raises(DataError, match="no column 'x'.*data.columns"):
        prepare_data(make_cfg(tmp_path, [str(tmp_path / "m.pq")]))


def test_fixed_batch_dim_is_checked_against_batch_size(tmp_path, parquet_source):
    cfg = make_cfg(tmp_path, [str(parquet_source)], inputs=_inputs_with("labels", shape=[4]), batch_size=2)
    with pytest.raises(DataError, match="column 'labels'.*train.batch_size"):
        prepare_data(cfg)


def test_fixed_batch_dim_is_checked_again_on_reuse(tmp_path, parquet_source):
    prepare_data(make_cfg(tmp_path, [str(parquet_source)], inputs=_inputs_with("labels", shape=[2]), batch_size=2))
    cfg = make_cfg(tmp_path, [str(parquet_source)], inputs=_inputs_with("labels", shape=[2]), batch_size=4)
    with pytest.raises(DataError, match="column 'labels'.*train.batch_size"):
        prepare_data(cfg)


def test_unknown_glob_and_extension_are_named(tmp_path):
    with pytest.raises(DataError, match="'.*nothing\\*.parquet' matches no file"):
        prepare_data(make_cfg(tmp_path, [str(tmp_path / "nothing*.parquet")]))
    (tmp_path / "d.xyz").write_text("1")
    with pytest.raises(DataError, match="d.xyz.*data.format"):
        prepare_data(make_cfg(tmp_path, [str(tmp_path / "d.xyz")]))


def test_manifest_is_written_last_and_lists_shards(tmp_path, parquet_source):
    cfg = make_cfg(tmp_path, [str(parquet_source)], rows_per_shard=7, eval_fraction=0.1)
    prepare_data(cfg)
    raw = json.loads((cfg.data_dir / "manifest.json").read_text())
    files = sorted(os.listdir(cfg.data_dir))
    assert files == ["eval-00000.arrow", "manifest.json"] + [f"train-0000{i}.arrow" for i in range(4)]
    newest = max(files, key=lambda f: (cfg.data_dir / f).stat().st_mtime_ns)
    assert newest == "manifest.json"
    assert [s["num_rows"] for s in raw["splits"]["train"]] == [7, 7, 7, 6]
    assert raw["format"] == 1 and raw["tokens_per_sample"] is None
    assert {s["name"]: s["row_shape"] for s in raw["schema"]} == {"ids": [], "x": [3], "labels": []}
