"""Bad source files end in a DataError naming the file, column or row and the fix, never in a raw exception."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataprep_helpers import TABLE_INPUTS, make_cfg, table_rows
from test_dataprep_values import RECORD

from ortflow.config.sealed import seal
from ortflow.dataprep import DataError, prepare_data


def _classifier(tmp_path, source):
    cfg = make_cfg(tmp_path, [str(source)])
    (cfg.output_dir / "configure.json").write_text(json.dumps(seal(RECORD)))  # sealed, as configure writes it
    return cfg


def test_a_nan_float_label_is_named(tmp_path):
    table = table_rows(20)
    labels = pa.array([float(i % 5) for i in range(20)], type=pa.float64()).to_numpy().copy()
    labels[3] = np.nan
    source = tmp_path / "train.parquet"
    pq.write_table(table.set_column(2, "labels", pa.array(labels)), source)
    with pytest.raises(DataError) as err:
        prepare_data(_classifier(tmp_path, source))
    assert "'labels'" in str(err.value) and "row 3" in str(err.value) and "NaN" in str(err.value)


def test_a_null_jsonl_label_is_named(tmp_path):
    source = tmp_path / "train.jsonl"
    rows = [{"ids": i, "x": [1.0, 2.0, 3.0], "labels": None if i == 4 else i % 5} for i in range(20)]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError) as err:
        prepare_data(_classifier(tmp_path, source))
    assert "'labels'" in str(err.value) and "row 4" in str(err.value) and "missing" in str(err.value)


def test_a_csv_with_a_duplicate_header_is_named(tmp_path):
    source = tmp_path / "train.csv"
    source.write_text("ids,x,labels,ids\n" + "".join(f"{i},{i}.0,{i % 5},{i}\n" for i in range(20)))
    inputs = [{"name": "ids", "dtype": "int64", "shape": ["B"]}, {"name": "labels", "dtype": "int64", "shape": ["B"]}]
    cfg = make_cfg(tmp_path, [str(source)], inputs=inputs)
    with pytest.raises(DataError) as err:
        prepare_data(cfg)
    assert str(source) in str(err.value) and "'ids'" in str(err.value) and "2 times" in str(err.value)


def test_an_npz_of_zero_dimensional_arrays_is_named(tmp_path):
    source = tmp_path / "train.npz"
    np.savez(source, ids=np.int64(1), x=np.float32(2.0), labels=np.int64(0))
    cfg = make_cfg(tmp_path, [str(source)], inputs=TABLE_INPUTS)
    with pytest.raises(DataError) as err:
        prepare_data(cfg)
    assert str(source) in str(err.value) and "0-d" in str(err.value) and "one row per sample" in str(err.value)


def test_int64_features_beyond_float32_precision_are_refused(tmp_path):
    source = tmp_path / "train.parquet"
    table = table_rows(20)
    ints = pa.array([[i + (1 << 25) + 1, 2, 3] for i in range(20)], type=pa.list_(pa.int64()))
    pq.write_table(table.set_column(1, "x", ints), source)
    with pytest.raises(DataError) as err:
        prepare_data(make_cfg(tmp_path, [str(source)]))
    assert "'x'" in str(err.value) and "2^24" in str(err.value)


def test_an_empty_table_source_is_not_blamed_on_text_settings(tmp_path):
    source = tmp_path / "train.parquet"
    pq.write_table(table_rows(0), source)
    with pytest.raises(DataError) as err:
        prepare_data(make_cfg(tmp_path, [str(source)]))
    assert "seq_len" not in str(err.value) and "no rows" in str(err.value)


def test_a_batch_larger_than_the_training_rows_is_refused(tmp_path):
    source = tmp_path / "train.parquet"
    pq.write_table(table_rows(6), source)
    with pytest.raises(DataError) as err:
        prepare_data(make_cfg(tmp_path, [str(source)], batch_size=8))
    assert "6 training row(s)" in str(err.value) and "fewer than the 8" in str(err.value)


def test_an_eval_fraction_that_leaves_too_few_training_rows_is_refused(tmp_path):
    source = tmp_path / "train.parquet"
    pq.write_table(table_rows(300), source)
    with pytest.raises(DataError) as err:
        prepare_data(make_cfg(tmp_path, [str(source)], batch_size=4, eval_fraction=0.99))
    assert "data.eval_fraction 0.99" in str(err.value) and "fewer than the 4" in str(err.value)
