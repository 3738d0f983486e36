"""Data preparation: sources -> checked, shuffled Arrow shards + manifest.json, and the rank-side loaders.

See docs/your-data.md. ``prepare_data`` runs once per run (it is a no-op when nothing changed); ranks use
``loader.verify_data`` (rank 0, once), ``loader.TrainLoader`` and ``loader.EvalLoader``.
"""

from ortflow.dataprep.errors import DataError
from ortflow.dataprep.loader import EvalLoader, TrainLoader, verify_data
from ortflow.dataprep.manifest import Manifest, read_manifest
from ortflow.dataprep.prepare_data import prepare_data

__all__ = ["DataError", "EvalLoader", "Manifest", "TrainLoader", "prepare_data", "read_manifest", "verify_data"]
