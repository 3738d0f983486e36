"""Tensor-parallel checkpoint files: each tensor-parallel rank's slices, and the whole tensors rebuilt from them.

Rank ``t`` of ``hp`` (its first data-parallel replica) writes ``params-tpTT-of-HH.h5`` and ``optimizer-tpTT-of-HH.h5``
in the format of ``params.h5`` / ``optimizer.h5`` (:mod:`ortflow.checkpoints.h5state`), holding its slices of the split
parameters (attributes ``tp_axis``, ``tp_parts``: a number, or the widths of unequal fused parts, ``tp_size``; an
optimizer state segment also ``tp_shape``, the slice's shape) and every replicated parameter whole (bitwise equal on
every tp rank: checked when merged). Readers that want whole tensors (export, ``ortflow checkpoint merge``, a warm
start at another size) get them merged here; a resuming rank reads its own two files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ortflow.checkpoints.folder import CheckpointError, h5_file
from ortflow.tensor_slices import merge_slices, parts_of


def tp_file(kind: str, rank: int, size: int, stage: tuple[int, int] | None = None) -> str:
    """Name of tensor-parallel rank ``rank``'s ``params`` or ``optimizer`` file (of pipeline stage ``(s, P)``)."""
    where = f"-stage{stage[0]:02d}-of-{stage[1]:02d}" if stage else ""
    return f"{kind}{where}-tp{rank:02d}-of-{size:02d}.h5"


def tp_shard_file(rank: int, size: int, stage: tuple[int, int] | None, replica: int, replicas: int) -> str:
    """Name of replica ``replica``'s optimizer file of tensor-parallel rank ``rank`` (ZeRO-1 shard, or Adasum's
    per-replica state)."""
    return f"{tp_file('optimizer', rank, size, stage)[:-3]}-rank{replica:05d}-of-{replicas:05d}.h5"


def tp_optimizer_files(folder: Path, rank: int, size: int, stage: tuple[int, int] | None = None) -> list[Path]:
    """Tensor-parallel rank ``rank``'s optimizer files in ``folder``: one, or one per replica."""
    whole = Path(folder) / tp_file("optimizer", rank, size, stage)
    shards = sorted(Path(folder).glob(f"{whole.stem}-rank*.h5"))
    return shards if shards and not whole.exists() else [whole]


def tp_files(folder: Path, kind: str) -> list[Path]:
    """A folder's tensor-parallel ``kind`` files in (stage and) rank order ([] if it is not a tensor-parallel
    checkpoint)."""
    return sorted(Path(folder).glob(f"{kind}-tp*-of-*.h5")) or sorted(Path(folder).glob(f"{kind}-stage*-tp*-of-*.h5"))


def by_stage(files: list[Path]) -> list[list[Path]]:
    """Tensor-parallel files grouped by pipeline stage (one group without pipeline stages), each in rank order."""
    groups: dict[str, list[Path]] = {}
    for path in files:
        groups.setdefault(path.name.split("-tp")[0], []).append(path)
    return [groups[k] for k in sorted(groups)]


def mark(ds, sliced: tuple | None) -> None:
    """Record how a dataset was sliced, ``(axis, parts, size, slice shape)``, on a tensor-parallel rank."""
    if sliced is not None:
        ds.attrs.update({"tp_axis": sliced[0], "tp_parts": sliced[1], "tp_size": sliced[2],
                         "tp_shape": list(sliced[3])})


def _merge(name: str, arrays: list[np.ndarray], attrs) -> np.ndarray:
    if "tp_axis" in attrs:
        return merge_slices(arrays, int(attrs["tp_axis"]), parts_of(attrs["tp_parts"]))
    for k, other in enumerate(arrays[1:], 1):
        if not np.array_equal(other, arrays[0]):
            raise CheckpointError(f"replicated tensor {name} differs between tensor-parallel rank 0 and {k}: the "
                                  "checkpoint is inconsistent; use another one")
    return arrays[0]


def read_merged_params(files: list[Path], names: set[str] | None = None) -> dict[str, np.ndarray]:
    """Whole parameters from every tensor-parallel rank's params file (of every pipeline stage)."""
    merged: dict[str, np.ndarray] = {}
    for group in by_stage(files):
        merged.update(_read_merged_group(group, names))
    return merged


def _read_merged_group(files: list[Path], names: set[str] | None) -> dict[str, np.ndarray]:
    by_name: dict[str, list] = {}
    attrs: dict[str, dict] = {}
    for path in files:
        with h5_file(path, "r") as f:
            for ds in f["parameters"].values():
                name = str(ds.attrs["name"])
                if names is None or name in names:
                    by_name.setdefault(name, []).append(ds[()])
                    attrs[name] = dict(ds.attrs)
    return {n: _merge(n, arrays, attrs[n]) for n, arrays in by_name.items()}


def by_tp_rank(files: list[Path]) -> list[list[Path]]:
    """One pipeline stage's optimizer files grouped by tensor-parallel rank, in rank order: one file each, or one per
    replica (ZeRO-1 shards, Adasum's per-replica states; of those, replica 0's alone)."""
    groups: dict[str, list[Path]] = {}
    for path in files:
        groups.setdefault(path.name.split("-rank")[0], []).append(path)
    chosen = []
    for key in sorted(groups):
        paths = sorted(groups[key])
        with h5_file(paths[0], "r") as f:
            replica = bool(f.attrs.get("replica", False))
        chosen.append(paths[:1] if replica else paths)
    return chosen


def _slice_states(paths: list[Path]) -> tuple[int, str, dict, dict]:
    """One tensor-parallel rank's optimizer states, each slice whole (its replicas' shards stitched)."""
    step, optimizer, flat, attrs = 0, "", {}, {}
    for path in paths:
        with h5_file(path, "r") as f:
            step, optimizer = int(f.attrs["step_count"]), str(f.attrs["optimizer"])
            for sname, group in f.items():
                for ds in group.values():
                    key = (sname, str(ds.attrs["name"]))
                    whole = flat.setdefault(key, np.zeros(int(ds.attrs["numel"]), np.float32))
                    whole[int(ds.attrs["lo"]) : int(ds.attrs["hi"])] = ds[()].reshape(-1)
                    attrs[key] = dict(ds.attrs)
    arrays = {k: v.reshape(tuple(attrs[k]["tp_shape"])) if "tp_shape" in attrs[k] else v for k, v in flat.items()}
    return step, optimizer, arrays, attrs


def merged_optimizer_pieces(files: list[Path]) -> tuple[int, str, dict[str, list[tuple[str, int, int, np.ndarray]]]]:
    """Step count, optimizer name and each state of every parameter whole (one piece each), from the tp files (of
    every pipeline stage: a tied parameter held by several stages is read from the first, whose copy equals the
    others)."""
    step, optimizer, by_key, attrs = 0, "", {}, {}
    for group_files in by_stage(files):
        earlier = set(by_key)  # a tied parameter held by several stages: the first stage's states
        for paths in by_tp_rank(group_files):
            step, optimizer, arrays, found = _slice_states(paths)
            for key, array in arrays.items():
                if key not in earlier:
                    by_key.setdefault(key, []).append(array)
                    attrs[key] = found[key]
    pieces: dict[str, list] = {}
    for (sname, name), arrays in sorted(by_key.items()):
        whole = _merge(f"{sname}/{name}", arrays, attrs[(sname, name)]).reshape(-1)
        pieces.setdefault(sname, []).append((name, 0, whole.size, whole))
    return step, optimizer, pieces
