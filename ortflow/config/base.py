"""What every config section shares: the frozen base model, path resolution, limits and the error type."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

#: Highest ONNX opset and IR version that onnxruntime-training 1.19.2 runs (docs/engine.md).
MAX_OPSET = 21
MAX_IR_VERSION = 10

#: Name of the resolved config that configure writes into the run folder; every rank loads it again.
RESOLVED_CONFIG_NAME = "config.yaml"


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` lists every reason, each naming the field and the fix."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        where = f" in {source}" if source else ""
        super().__init__(f"{len(problems)} problem(s){where}:\n" + "\n".join(f"  - {p}" for p in problems))


#: Upper bound of counts and sizes (steps, rows, batch sizes): far beyond any real run, well inside int64 arithmetic.
MAX_COUNT = 2**31 - 1


#: URL schemes of the object stores ortflow reads and writes through fsspec, with the package each needs.
REMOTE_SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
LOCAL_SCHEME = "file"
URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(value: object) -> str | None:
    """The scheme of a ``scheme://...`` string (lower case), or None for a plain path."""
    match = URL_RE.match(value) if isinstance(value, str) else None
    return match.group(1).lower() if match else None


def is_remote(value: object) -> bool:
    """True for a URL of a supported object store (``s3://``, ``gs://``, ``az://``, ``abfs://``)."""
    return url_scheme(value) in REMOTE_SCHEMES


def url_problem(value: object, field: str, remote_ok: bool) -> str | None:
    """Why ``value`` cannot stand in ``field``: an unknown scheme, a remote URL where only local paths work, or a URL
    without a bucket; None when it can."""
    scheme = url_scheme(value)
    if scheme is None or scheme == LOCAL_SCHEME:
        return None
    if scheme not in REMOTE_SCHEMES:
        known = ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
        return (f"{field}: '{value}' uses the scheme {scheme}://, which ortflow does not read; use {known}, "
                f"file:// or a local path")
    if not remote_ok:
        return (f"{field}: '{value}' is a remote URL, but this field takes a local path; object storage works for "
                "output_dir and data.train/data.test (docs/operations.md)")
    if not str(value)[len(scheme) + 3:].split("/", 1)[0]:
        return f"{field}: '{value}' names no bucket; write {scheme}://BUCKET/PATH"
    return None


def local_path(value: str) -> str:
    """A ``file://`` URL as a plain path (``file:///data/x`` -> ``/data/x``); anything else unchanged."""
    return value[len("file://"):] if url_scheme(value) == LOCAL_SCHEME else value



def _is_number_field(annotation: Any) -> bool:
    kinds = getattr(annotation, "__args__", None) or (annotation,)
    # `Annotated[int, Field(gt=0)] | Literal["auto"]` (num_ranks): a member's constraints wrap its type
    kinds = tuple(get_args(kind)[0] if get_origin(kind) is Annotated else kind for kind in kinds)
    return any(kind in (int, float) for kind in kinds) and bool not in kinds


class Section(BaseModel):
    # allow_inf_nan=False: .inf / .nan in a float field is refused (it would train to NaN losses with exit 0).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        # pydantic reads `batch_size: true` as 1; a boolean in a number field is always a mistake.
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is None or not _is_number_field(field.annotation):
                    continue
                if isinstance(value, bool):
                    raise ValueError(f"{name} is `{str(value).lower()}`, a boolean; give a number")
                if isinstance(value, int) and abs(value) > MAX_COUNT:
                    raise ValueError(f"{name} is {value}, beyond any real run; give at most {MAX_COUNT}")
            data = _local_path_fields(cls, data)
        return data


def _local_path_fields(cls: type[BaseModel], data: dict) -> dict:
    # A URL in a path field would become a local folder named "s3:"; file:// URLs are plain paths.
    fixed = {}
    for name, value in data.items():
        field = cls.model_fields.get(name)
        if field is None or url_scheme(value) is None or Path not in (getattr(field.annotation, "__args__", None)
                                                                       or (field.annotation,)):
            continue
        problem = url_problem(value, name, remote_ok=False)
        if problem:
            raise ValueError(problem)
        fixed[name] = local_path(value)
    return {**data, **fixed} if fixed else data


def absolute_path(value: Path | str, base_dir: Path | str | None) -> Path:
    """``value`` (``~`` expanded) as an absolute path: a relative one joined to ``base_dir``, the config file's folder,
    or, for a config built without one (in Python), to the current folder at the time it is built. Resolved once, a
    path keeps its meaning when a later step changes the current folder (the engine builds in a scratch folder).

    Raises:
        ValueError: the path is relative, no ``base_dir`` is given and the current folder no longer exists.
    """
    value = Path(value).expanduser()
    if value.is_absolute():
        return value
    if base_dir is None:
        try:
            base_dir = Path.cwd()
        except FileNotFoundError:
            raise ValueError(f"'{value}' is relative to the current folder, which no longer exists; give an absolute "
                             "path") from None
    return Path(base_dir) / value


def resolve_path(value: Path | None, info: ValidationInfo) -> Path | None:
    """Relative paths resolve against the config file's folder (passed as validation context ``base_dir``), else the
    current folder (:func:`absolute_path`)."""
    if value is None:
        return None
    value = absolute_path(value, (info.context or {}).get("base_dir"))
    long_parts = [part for part in value.parts if len(os.fsencode(part)) > NAME_MAX]
    if long_parts:
        size = len(os.fsencode(long_parts[0]))
        raise ValueError(f"the name '{long_parts[0][:40]}...' in this path has {size} bytes; file systems allow "
                         f"{NAME_MAX}: choose a shorter name")
    if len(os.fsencode(str(value))) >= PATH_MAX:
        raise ValueError(f"the path has {len(os.fsencode(str(value)))} bytes; the system allows {PATH_MAX - 1}: choose "
                         "a shorter path")
    return value


#: Longest file name and path the Linux system calls take (bytes).
NAME_MAX, PATH_MAX = 255, 4096



LossName = Literal["cross_entropy", "mse", "bce_with_logits", "l1", "model_output"]


def regular_file_problem(path: Path, max_bytes: int, what: str) -> str | None:
    """Why ``path`` cannot be read whole as ``what``: not a regular file (a device or FIFO reads forever), or too large.

    Returns None when it can be read.
    """
    import stat

    try:
        st = path.stat()
    except OSError as err:
        return f"cannot read {path}: {err.strerror}; check the path"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a device, FIFO or folder); give the path of {what} file"
    if st.st_size > max_bytes:
        return (f"{path} holds {st.st_size} bytes, more than {what} can ({max_bytes}); check that the path names "
                f"{what} file")
    return None
