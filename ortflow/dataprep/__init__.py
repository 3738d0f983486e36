"""Data preparation: sources -> checked, shuffled Arrow shards + manifest.json, and the rank-side loaders.

See docs/your-data.md. ``prepare_data`` runs once per run (it is a no-op when nothing changed); ranks use
``loader.verify_data`` (rank 0, once), ``loader.TrainLoader`` and ``loader.EvalLoader``.
"""

from typing import TYPE_CHECKING

from ortflow.dataprep.errors import DataError
from ortflow.dataprep.loader import EvalLoader, TrainLoader, verify_data
from ortflow.dataprep.manifest import Manifest, read_manifest

if TYPE_CHECKING:
    from ortflow.dataprep.preparation import prepare_data

__all__ = ["DataError", "EvalLoader", "Manifest", "TrainLoader", "prepare_data", "read_manifest", "verify_data"]


def __getattr__(name: str):
    # ``prepare_data`` is imported when first asked for: its readers (pyarrow.compute, parquet, CSV, JSON) cost a
    # process about half a second to import, and ranks only read shards (:mod:`.loader`).
    if name == "prepare_data":
        from ortflow.dataprep.preparation import prepare_data

        globals()[name] = prepare_data
        return prepare_data
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
