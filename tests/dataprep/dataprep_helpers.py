"""Helpers for the dataprep tests: a RunConfig and a configure.json on tiny data in tmp_path.

Imported by name: pytest puts this folder on sys.path (the tests folders have no __init__.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ortflow.config import RunConfig, config_from_dict
from ortflow.config.sealed import seal

#: The inputs of a small tabular model: an id (to follow rows), a feature vector and a label.
TABLE_INPUTS = [
    {"name": "ids", "dtype": "int64", "shape": ["B"]},
    {"name": "x", "dtype": "float32", "shape": ["B", 3]},
    {"name": "labels", "dtype": "int64", "shape": ["B"]},
]


def make_cfg(tmp_path: Path, train, inputs=TABLE_INPUTS, run="run", batch_size=2, seed=0, **data) -> RunConfig:
    """A RunConfig whose run folder holds a configure.json listing ``inputs``."""
    out = tmp_path / run
    out.mkdir(exist_ok=True)
    (out / "configure.json").write_text(json.dumps(seal({"train_inputs": inputs})))  # sealed, as configure writes it
    model = tmp_path / "model.onnx"
    model.write_bytes(b"not checked here")
    data.setdefault("eval_fraction", 0.0)
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model)},
        "data": {"train": train, **data},
        "train": {"batch_size": batch_size, "num_train_steps": 1, "seed": seed},
    }
    return config_from_dict(raw, base_dir=tmp_path)


def table_rows(n: int, start: int = 0) -> pa.Table:
    """``n`` rows whose values all derive from their id, so a row can be checked from its id alone."""
    ids = np.arange(start, start + n, dtype=np.int64)
    x = np.stack([ids * 1.0, ids * 2.0, ids * 3.0], axis=1).astype(np.float32)
    return pa.table({"ids": ids, "x": pa.array(list(x), type=pa.list_(pa.float32())), "labels": ids % 5})


def write_parquet(path: Path, n: int, start: int = 0) -> Path:
    pq.write_table(table_rows(n, start), path)
    return path


def check_rows(feeds: dict[str, np.ndarray]) -> None:
    """Every row's x and label match its id (rows are not mixed up across columns)."""
    ids = feeds["ids"]
    np.testing.assert_array_equal(feeds["x"], np.stack([ids, ids * 2, ids * 3], axis=1).astype(np.float32))
    np.testing.assert_array_equal(feeds["labels"], ids % 5)
