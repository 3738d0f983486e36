"""Object storage through fsspec: a remote folder with retried operations, and the sync of a run folder's local copy.

Only runs whose ``output_dir`` or sources are URLs (``s3://``, ``gs://``, ``az://``) use this package; local runs never
import fsspec. The URL rules and the ``storage`` config section live in :mod:`ortflow.config.storage`.
"""

from ortflow.storage.remote_dir import RemoteDir, StorageAccessDenied, StorageError, filesystem
from ortflow.storage.sync import FolderSync

__all__ = ["FolderSync", "RemoteDir", "StorageAccessDenied", "StorageError", "filesystem"]
