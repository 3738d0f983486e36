"""data.columns: one input from a list of columns or a glob, stacked into a [k] row, in every table format."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import DataError, EvalLoader, TrainLoader, prepare_data, read_manifest
from ortflow.dataprep.features import natural_key
from ortflow.examples.mlp import build_mlp
from tests.support.runs import final_parameters, run_ranks

NUM_FEATURES = 11  # f0..f10: natural order differs from sorted order (f10 sorts before f2)


def feature_matrix(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, NUM_FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def write_table(path, x, y, fmt):
    """One column per feature, shuffled so the file order is not the natural order."""
    order = np.random.default_rng(0).permutation(NUM_FEATURES)
    columns = {f"f{j}": pa.array(x[:, j]) for j in order}
    table = pa.table({"label": y, **columns, "other": np.zeros(len(y))})
    if fmt == "csv":
        # float32 values written with their shortest round-trip text, so parsing them back gives the same bits
        lines = [",".join(table.column_names)]
        for i in range(len(y)):
            lines.append(",".join(str(y[i]) if c == "label" else ("0" if c == "other" else repr(float(
                np.float32(x[i, int(c[1:])])))) for c in table.column_names))  # fmt: skip
        path.write_text("\n".join(lines) + "\n")
    elif fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "arrow":
        feather.write_feather(table, path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({k: table.column(k)[i].as_py() for k in table.column_names}) + "\n"
                                for i in range(len(y))))  # fmt: skip
    return path


def make(tmp_path, name, source, columns, steps=1):
    model = tmp_path / "mlp.onnx"
    if not model.exists():
        build_mlp(model, num_features=NUM_FEATURES, hidden=8, num_classes=2, seed=0)
    cfg = config_from_dict({
        "name": name, "output_dir": str(tmp_path / name), "model": {"path": str(model)},
        "data": {"train": [str(source)], "columns": columns, "eval_fraction": 0.25},
        "train": {"batch_size": 4, "num_train_steps": steps, "evaluation_period": 0},
        "checkpoint": {"period": 0},
    })  # fmt: skip
    configure(cfg)
    return cfg


def test_natural_order_puts_f2_before_f10():
    assert sorted(["f10", "f2", "f1", "f0"], key=natural_key) == ["f0", "f1", "f2", "f10"]


@pytest.mark.parametrize("fmt", ["csv", "parquet", "arrow", "jsonl"])
@pytest.mark.parametrize("spec", ["f*", [f"f{j}" for j in range(NUM_FEATURES)]])
def test_feature_columns_stack_into_one_row_in_natural_order(tmp_path, fmt, spec):
    x, y = feature_matrix(40)
    source = write_table(tmp_path / f"t.{fmt}", x, y, fmt)
    cfg = make(tmp_path, "run", source, {"features": spec, "labels": "label"})
    manifest = prepare_data(cfg)
    info = {i.name: i for i in manifest.inputs}["features"]
    assert info.row_shape == [NUM_FEATURES] and info.column == f"f0,...,f10 ({NUM_FEATURES} columns)"
    rows = [EvalLoader(cfg.data_dir, 100, 0, 1).batches(), [(next(TrainLoader(cfg.data_dir, 30, 0, 1).iter_from(0)),
                                                             30)]]  # fmt: skip
    for batches in rows:
        for feeds, _ in batches:
            for row, label in zip(feeds["features"], feeds["labels"], strict=True):
                match = np.flatnonzero((x == row).all(axis=1))  # every row is one source row, columns in order
                assert len(match) == 1 and y[match[0]] == label


def test_missing_column_and_empty_pattern_are_named(tmp_path):
    x, y = feature_matrix(8)
    source = write_table(tmp_path / "t.csv", x, y, "csv")
    with pytest.raises(DataError, match=r"data.columns.features: pattern 'g\*' matches no column"):
        prepare_data(make(tmp_path, "a", source, {"features": "g*", "labels": "label"}))
    with pytest.raises(DataError, match="no column 'f99' for model input 'features'"):
        prepare_data(make(tmp_path, "b", source, {"features": ["f0", "f99"], "labels": "label"}))


def test_sources_must_agree_on_the_feature_columns(tmp_path):
    x, y = feature_matrix(8)
    write_table(tmp_path / "a.csv", x, y, "csv")
    pcsv.write_csv(pa.table({"label": y, **{f"f{j}": x[:, j] for j in range(NUM_FEATURES - 1)}}), tmp_path / "b.csv")
    cfg = make(tmp_path, "run", tmp_path / "*.csv", {"features": "f*", "labels": "label"})
    with pytest.raises(DataError, match=r"data.columns.features: 'f\*' gives columns .* in .*b.csv"):
        prepare_data(cfg)


@pytest.mark.mpi
def test_csv_feature_columns_train_bit_identically_to_a_parquet_vector_column(tmp_path):
    x, y = feature_matrix(64)
    csv = write_table(tmp_path / "cols.csv", x, y, "csv")
    vector = tmp_path / "vector.parquet"
    pq.write_table(pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())), "labels": y}), vector)
    by_columns = make(tmp_path, "columns", csv, {"features": "f*", "labels": "label"}, steps=6)
    by_vector = make(tmp_path, "vector", vector, {}, steps=6)
    for cfg in (by_columns, by_vector):
        prepare_data(cfg)
        out = run_ranks(cfg)
        assert out.returncode == 0, out.stdout
    assert read_manifest(by_columns.data_dir).num_rows("train") == 48
    a, b = final_parameters(by_columns), final_parameters(by_vector)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
