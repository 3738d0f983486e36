"""Fixtures of the dataprep tests."""

from pathlib import Path

import pytest
from dataprep_helpers import write_parquet


@pytest.fixture
def parquet_source(tmp_path: Path) -> Path:
    """A 30-row parquet file (ids 0..29)."""
    return write_parquet(tmp_path / "train.parquet", 30)
