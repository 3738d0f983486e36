"""prepare-data refuses values that would train a wrong model, naming file, column, rows and the fix."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from dataprep_helpers import TABLE_INPUTS, make_cfg, table_rows

from ortflow.config.sealed import seal
from ortflow.dataprep import DataError, prepare_data, verify_data
from ortflow.dataprep.values import ValueRules, check_column, rules_from_record

#: What configure writes for a 5-class classifier whose loss reads `logits`.
RECORD = {
    "train_inputs": TABLE_INPUTS,
    "label_input": "labels",
    "loss_output": "logits",
    "model_outputs": [{"name": "logits", "dtype": "float32", "shape": ["B", 5]}],
}


def classifier_cfg(tmp_path, source, ignore_index=None, classes=5):
    cfg = make_cfg(tmp_path, [str(source)])
    record = json.loads(json.dumps(RECORD))
    record["model_outputs"][0]["shape"][-1] = classes
    (cfg.output_dir / "configure.json").write_text(json.dumps(seal(record)))  # sealed, as configure writes it
    if ignore_index is not None:
        raw = cfg.model_dump(mode="json")
        raw["model"]["ignore_index"] = ignore_index
        cfg = type(cfg).model_validate(raw)
    return cfg


def write_table(tmp_path, table, name="train.parquet"):
    path = tmp_path / name
    if name.endswith(".csv"):
        flat = table.drop_columns(["x"]).append_column("x", pa.array(
            [float(v[0]) for v in table["x"].to_pylist()], type=pa.float64()))
        pcsv.write_csv(flat, path)
    else:
        pq.write_table(table, path)
    return path


def with_labels(labels):
    table = table_rows(len(labels))
    return table.set_column(2, "labels", pa.array(labels, type=pa.int64()))


@pytest.mark.parametrize("bad", [5, -1, 2**40])
def test_labels_outside_the_class_count_are_refused(tmp_path, bad):
    labels = [i % 5 for i in range(30)]
    labels[7] = labels[9] = bad
    cfg = classifier_cfg(tmp_path, write_table(tmp_path, with_labels(labels)))
    with pytest.raises(DataError) as err:
        prepare_data(cfg)
    message = str(err.value)
    assert "train.parquet" in message and "column 'labels'" in message
    assert "rows 7..9 (2 value(s))" in message and f"[{bad}]" in message and "outside 0..4" in message
    assert f"model.ignore_index: {bad}" in message  # the fix for users who mean it
    assert not (cfg.data_dir / "manifest.json").exists()  # nothing was published


def test_ignore_index_admits_exactly_that_value(tmp_path):
    labels = [i % 5 for i in range(30)]
    labels[3] = -100
    cfg = classifier_cfg(tmp_path, write_table(tmp_path, with_labels(labels)), ignore_index=-100)
    assert prepare_data(cfg).num_rows("train") == 30
    labels[4] = -1  # any other negative label is still refused
    cfg = classifier_cfg(tmp_path, write_table(tmp_path, with_labels(labels), "other.parquet"), ignore_index=-100)
    with pytest.raises(DataError, match=r"class labels \[-1\] at row 4 "):
        prepare_data(cfg)


def test_labels_in_a_csv_are_checked_with_row_numbers(tmp_path):
    labels = [i % 5 for i in range(30)]
    labels[29] = 6
    cfg = classifier_cfg(tmp_path, write_table(tmp_path, with_labels(labels), "train.csv"))
    with pytest.raises(DataError, match=r"train\.csv\): class labels \[6\] at row 29 "):
        prepare_data(cfg)


@pytest.mark.parametrize("value, words", [
    (np.nan, r"non-finite values \(nan\) at row 11 "),
    (np.inf, r"non-finite values \(inf\) at row 11 "),
    (1e39, r"values up to 1e\+39 at row 11 .*exceed float32's range"),
])
def test_non_finite_and_float32_overflow_features_are_refused(tmp_path, value, words):
    table = table_rows(30)
    x = np.stack([np.arange(30.0)] * 3, axis=1)
    x[11, 2] = value
    table = table.set_column(1, "x", pa.array(list(x), type=pa.list_(pa.float64())))
    cfg = make_cfg(tmp_path, [str(write_table(tmp_path, table))])
    with pytest.raises(DataError, match=r"column 'x' \(.*train\.parquet\): " + words + ".*source"):
        prepare_data(cfg)


def test_a_refused_source_keeps_the_earlier_shards(tmp_path):
    good = write_table(tmp_path, with_labels([i % 5 for i in range(30)]))
    cfg = classifier_cfg(tmp_path, good)
    prepare_data(cfg)
    before = (cfg.data_dir / "manifest.json").read_bytes()
    labels = [i % 5 for i in range(30)]
    labels[0] = 9
    write_table(tmp_path, with_labels(labels))
    with pytest.raises(DataError, match="class labels"):
        prepare_data(cfg)
    assert (cfg.data_dir / "manifest.json").read_bytes() == before
    verify_data(cfg.data_dir)


def test_rules_from_the_configure_record():
    rules = rules_from_record(RECORD, "cross_entropy", None)
    assert rules == ValueRules("labels", 5, None, frozenset({"x"}))
    assert rules_from_record(RECORD, "mse", None).label_input is None  # mse targets are not classes
    symbolic = json.loads(json.dumps(RECORD))
    symbolic["model_outputs"][0]["shape"] = ["B", "V"]
    rules = rules_from_record(symbolic, "cross_entropy", None)
    assert rules.num_classes is None
    with pytest.raises(DataError, match="class labels \\[-3\\].*outside >= 0"):  # no class count: negatives still
        check_column(np.array([1, -3]), "labels", rules, "labels", "f.npz", 0)
    check_column(np.array([1, 10**6]), "labels", rules, "labels", "f.npz", 0)


def test_a_truncated_npz_is_named(tmp_path):
    path = tmp_path / "train.npz"
    np.savez(path, ids=np.arange(30), x=np.zeros((30, 3), np.float32), labels=np.arange(30) % 5)
    path.write_bytes(path.read_bytes()[:-200])
    cfg = make_cfg(tmp_path, [str(path)])
    with pytest.raises(DataError, match=r"train\.npz: cannot read it as npz .*check the file"):
        prepare_data(cfg)


def test_validate_reports_bad_values_of_a_configured_run(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from ortflow.cli import app
    from ortflow.config import load_config
    from ortflow.configure.configure import configure
    from ortflow.examples.mlp import build_mlp

    build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3, seed=0)
    labels = np.arange(40) % 3
    labels[17] = 3
    np.savez(tmp_path / "train.npz", features=np.zeros((40, 4), np.float32), labels=labels)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"output_dir": "run", "model": {"path": "mlp.onnx"},
                                      "data": {"train": "train.npz"},
                                      "train": {"batch_size": 4, "num_train_steps": 2}}))
    runner = CliRunner()
    assert runner.invoke(app, ["validate", str(config)]).exit_code == 0  # before configure the class count is unknown
    configure(load_config(config))
    result = runner.invoke(app, ["validate", str(config)])
    assert result.exit_code == 1
    assert "class labels [3] at row 17" in result.output and "train.npz" in result.output
