"""verify_data and the loaders detect damaged data, naming the file and the fix."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from dataprep_helpers import make_cfg

from ortflow.dataprep import DataError, TrainLoader, prepare_data, verify_data
from ortflow.dataprep.manifest import CHECKSUM_KEY, content_checksum, sha256_file


@pytest.fixture
def data_dir(tmp_path, parquet_source):
    cfg = make_cfg(tmp_path, [str(parquet_source)], rows_per_shard=8)
    prepare_data(cfg)
    assert verify_data(cfg.data_dir).num_rows("train") == 30
    return cfg.data_dir


def test_truncated_shard(data_dir):
    shard = data_dir / "train-00002.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"train-00002\.arrow has \d+ bytes.*truncated.*re-run prepare-data"):
        verify_data(data_dir)


def test_altered_shard_same_size(data_dir):
    shard = data_dir / "train-00001.arrow"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train-00001\.arrow does not match its sha256.*re-run prepare-data"):
        verify_data(data_dir)


def test_missing_shard_and_missing_manifest(data_dir):
    (data_dir / "train-00003.arrow").unlink()
    with pytest.raises(DataError, match=r"train-00003\.arrow is missing.*re-run prepare-data"):
        verify_data(data_dir)
    (data_dir / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json does not exist.*prepare-data"):
        verify_data(data_dir)


def _rewrite_with_schema_change(path):
    """Replace a shard by one whose x column is float64, keeping the manifest's size and checksum in step."""
    with pa.memory_map(str(path)) as mm:
        table = ipc.open_file(mm).read_all()
    x = table["x"].cast(pa.list_(pa.float64(), 3))
    table = table.set_column(1, pa.field("x", x.type, metadata={"row_shape": "[3]"}), x)
    with ipc.new_file(str(path), table.schema.with_metadata({"ortflow.format": "1"})) as w:
        w.write_table(table)
    manifest_path = path.parent / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    for shard in raw["splits"]["train"]:
        if shard["file"] == path.name:
            shard.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    raw[CHECKSUM_KEY] = content_checksum(raw)  # a consistent manifest: only the shard's schema is wrong
    manifest_path.write_text(json.dumps(raw))


def test_schema_change_is_detected_by_verify_and_loader(data_dir):
    _rewrite_with_schema_change(data_dir / "train-00000.arrow")
    with pytest.raises(DataError, match=r"train-00000\.arrow: schema .*double.*re-run prepare-data"):
        verify_data(data_dir)
    with pytest.raises(DataError, match=r"train-00000\.arrow: schema"):
        TrainLoader(data_dir, 2, 0, 1)


def test_other_format_version_is_refused(data_dir):
    manifest_path = data_dir / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps(dict(raw, format=99)))
    with pytest.raises(DataError, match="data format 99.*re-run prepare-data"):
        verify_data(data_dir)


def test_damaged_manifest_is_named(data_dir):
    (data_dir / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"manifest\.json is damaged.*re-run prepare-data"):
        verify_data(data_dir)


@pytest.mark.parametrize("edit", ["seed", "flip", "rows"])
def test_any_manifest_edit_is_detected(data_dir, edit):
    path = data_dir / "manifest.json"
    text = path.read_text()
    if edit == "seed":  # the case: seed 0 -> 1 resumed silently into different parameters
        raw = json.loads(text)
        raw["seed"] += 1
        path.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    elif edit == "rows":
        raw = json.loads(text)
        raw["splits"]["train"][0]["num_rows"] += 1
        path.write_text(json.dumps(raw))
    else:  # one flipped bit anywhere in a digit keeps valid JSON
        pos = next(i for i, c in enumerate(text) if c.isdigit() and i > len(text) // 2)
        path.write_text(text[:pos] + chr(ord(text[pos]) ^ 1) + text[pos + 1 :])
    with pytest.raises(DataError, match=r"manifest\.json does not match its checksum.*re-run prepare-data"):
        verify_data(data_dir)
