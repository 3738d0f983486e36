"""``manifest.json``: what the shards hold, written last by prepare_data and checked by every reader."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ortflow.config.atomic import write_text_atomic
from ortflow.dataprep.errors import DataError

#: Version of the shard layout; stored in every shard's schema metadata and in the manifest.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "eval")
#: The manifest's own sha256, over its other fields (canonical JSON): any edit or flipped bit is detected.
CHECKSUM_KEY = "manifest_sha256"


def content_checksum(data: dict) -> str:
    """sha256 of a manifest's fields other than the checksum, as canonical JSON."""
    body = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """One shard file (name relative to the data folder)."""

    file: str
    num_rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class InputInfo:
    """How one model input is stored: its source column, dtype, per-row shape, and whether the loader merges dims."""

    name: str
    column: str
    dtype: str
    shape: list  # the model's declared shape (ints and symbolic names)
    row_shape: list[int]
    merge_leading_dims: bool


@dataclass(frozen=True)
class Manifest:
    """The prepared data set. ``reused`` is True when prepare_data found it up to date (not stored on disk)."""

    format: int
    fingerprint: str
    seed: int
    inputs: list[InputInfo]
    schema: list[dict]
    splits: dict[str, list[ShardInfo]]
    tokens_per_sample: int | None
    sources: dict[str, list[str]]
    reused: bool = field(default=False, compare=False)

    def num_rows(self, split: str) -> int:
        """Rows in a split ('train' or 'eval')."""
        return sum(s.num_rows for s in self.splits[split])

    @property
    def num_bytes(self) -> int:
        """Bytes of all shards."""
        return sum(s.bytes for shards in self.splits.values() for s in shards)

    def to_json(self) -> str:
        """The manifest as JSON (without ``reused``), with stable key order and its own checksum."""
        data = asdict(self)
        data.pop("reused")
        data[CHECKSUM_KEY] = content_checksum(data)
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    def with_reused(self, reused: bool) -> Manifest:
        """A copy with the ``reused`` flag set."""
        return replace(self, reused=reused)


def read_manifest(data_dir: Path) -> Manifest:
    """Read ``<data_dir>/manifest.json``.

    Raises:
        DataError: missing, unreadable, or of another format version; the message says to re-run prepare-data.
    """
    path = Path(data_dir) / MANIFEST_NAME
    if not path.exists():
        raise DataError(f"{path} does not exist: prepare the data first (`ortflow prepare-data CONFIG`)")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        if raw.get("format") != FORMAT_VERSION:
            raise DataError(
                f"{path}: data format {raw.get('format')} but this ortflow reads format {FORMAT_VERSION}; "
                f"re-run prepare-data"
            )
        stored = raw.pop(CHECKSUM_KEY, None)
        if stored != content_checksum(raw):
            why = "has no checksum (written by an older ortflow)" if stored is None else "does not match its checksum"
            raise DataError(f"{path} {why}: it was edited or corrupted; re-run prepare-data")
        raw["inputs"] = [InputInfo(**i) for i in raw["inputs"]]
        raw["splits"] = {k: [ShardInfo(**s) for s in raw["splits"].get(k, [])] for k in SPLITS}
        return Manifest(**raw)
    except DataError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is damaged ({type(err).__name__}: {err}); re-run prepare-data") from None


def write_manifest(manifest: Manifest, data_dir: Path) -> Path:
    """Write the manifest atomically (temporary file, fsync, rename), so a reader sees a whole one or none."""
    path = Path(data_dir) / MANIFEST_NAME
    write_text_atomic(path, manifest.to_json(), fsync=True)
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
