"""``ortflow checkpoint inspect|verify|merge``: read a checkpoint folder without the engine.

``merge`` writes one HDF5 file that plain h5py/numpy can read: ``/parameters/<name>`` (every parameter, its shape)
and ``/optimizer/<state>/<name>`` (each state tensor whole, gathered from all ranks' shards, the parameter's shape),
names as in the ONNX model (``/`` and ``%`` escaped as ``%2F`` and ``%25``; the ``name`` attribute keeps the original),
root attributes ``step``, ``step_count``, ``optimizer``, ``global_cursor`` and the source's ``meta.json`` as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from ortflow.checkpoints.folder import CheckpointInfo, verify
from ortflow.checkpoints.h5state import escape, optimizer_files, read_params, state_pieces


def inspect(path: Path) -> dict:
    """A JSON-ready summary of a verified checkpoint: step, cursor, files, parameters, optimizer state and shards."""
    info = verify(path)
    params = read_params(info.path)
    step_count, optimizer, pieces = state_pieces(info.path)
    return {
        "path": str(info.path),
        "format": info.format,
        "step": info.step,
        "global_cursor": info.global_cursor,
        "num_ranks": info.meta.get("num_ranks"),
        "optimizer": optimizer,
        "optimizer_step_count": step_count,
        "files": {name: record["bytes"] for name, record in info.meta["files"].items()},
        "optimizer_files": [p.name for p in optimizer_files(info.path)],
        "num_parameters": len(params),
        "num_values": int(sum(v.size for v in params.values())),
        "parameters": {name: list(v.shape) for name, v in sorted(params.items())},
        "optimizer_state": sorted(pieces),
    }


def merge(path: Path, out: Path) -> CheckpointInfo:
    """Write the checkpoint at ``path`` (verified first) as one HDF5 file ``out`` (written atomically).

    Returns:
        The verified source checkpoint.
    """
    info = verify(path)
    params = read_params(info.path)
    step_count, optimizer, pieces = state_pieces(info.path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        # HDF5 writes through a Python file: a full disk is an OSError here, not a failed HDF5 close that leaves the
        # library's state behind (tracebacks from its finalizers and a crash as the interpreter exits).
        with open(tmp, "wb") as raw, h5py.File(raw, "w") as f:
            f.attrs.update({"step": info.step, "step_count": step_count, "optimizer": optimizer or "",
                            "global_cursor": info.global_cursor or 0, "meta": json.dumps(info.meta, sort_keys=True)})
            group = f.create_group("parameters")
            for name in sorted(params):
                group.create_dataset(escape(name), data=params[name]).attrs["name"] = name
            opt = f.create_group("optimizer")
            for sname, parts in sorted(pieces.items()):
                sgroup = opt.create_group(sname)
                for name in sorted({p[0] for p in parts}):
                    whole = np.empty(params[name].size, dtype=np.float32)
                    covered = 0
                    for _, lo, hi, values in (p for p in parts if p[0] == name):
                        whole[lo:hi] = values
                        covered += hi - lo
                    if covered != whole.size:
                        raise ValueError(f"{info.path.name}: {sname} of {name} covers {covered} of {whole.size}")
                    sgroup.create_dataset(escape(name), data=whole.reshape(params[name].shape)).attrs["name"] = name
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return info
