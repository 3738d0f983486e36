"""The HDF5 files of a checkpoint (format 2): parameters once, optimizer state whole or one file per rank.

``params.h5``: group ``parameters`` with one dataset per parameter (float32, the tensor's shape; the ONNX name in the
``name`` attribute and, with ``/`` and ``%`` escaped, as the dataset name), attribute ``requires_grad``; group
``extra_state`` with the small arrays of the ``extra_state`` hook (e.g. a loss scaler).
``optimizer.h5`` (ZeRO-0, written by rank 0) or ``optimizer-rank%05d-of-%05d.h5`` (ZeRO-1, each rank its own): one group
per state name (``exp_avg``, ``exp_avg_sq``, ``momentum``), in it one 1-D dataset per segment with attributes ``name``,
``lo``, ``hi`` (element range of the flattened tensor) and ``numel``; root attributes ``step_count``, ``optimizer``,
``rank``, ``world_size``. Any number of optimizer files is read back into any sharding (resume on another rank count).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow.checkpoints import tp as tpfiles
from ortflow.checkpoints.folder import CHECKPOINT_FILE, PARAMS_FILE, CheckpointError, h5_file
from ortflow.tensor_slices import parts_of

log = logging.getLogger("ortflow.checkpoints")

OPTIMIZER_FILE = "optimizer.h5"


def shard_file(rank: int, world: int) -> str:
    """Name of rank ``rank``'s optimizer-state file under ZeRO-1."""
    return f"optimizer-rank{rank:05d}-of-{world:05d}.h5"


def stage_file(kind: str, stage: int, num_stages: int) -> str:
    """Name of a pipeline stage's ``params`` or ``optimizer`` file."""
    return f"{kind}-stage{stage:02d}-of-{num_stages:02d}.h5"


def stage_shard_file(stage: int, num_stages: int, rank: int, world: int) -> str:
    """Name of a pipeline stage's replica ``rank``'s optimizer file (ZeRO-1 shard, or Adasum's per-replica state)."""
    return f"optimizer-stage{stage:02d}-of-{num_stages:02d}-rank{rank:05d}-of-{world:05d}.h5"


def stage_optimizer_files(folder: Path, stage: int, num_stages: int) -> list[Path] | None:
    """A pipeline stage's optimizer files in ``folder`` (whole or per replica); None when it has none of its own (a
    checkpoint of the unsplit model: every file is read)."""
    found = sorted(Path(folder).glob(f"optimizer-stage{stage:02d}-of-{num_stages:02d}*.h5"))
    return found or None


def escape(name: str) -> str:
    """An ONNX name as an HDF5 dataset name (``/`` would make groups)."""
    return name.replace("%", "%25").replace("/", "%2F")


@dataclass
class TrainState:
    """What a rank contributes to a checkpoint.

    Attributes:
        parameters: Returns every parameter (trainable and frozen) by name, host arrays; called by the ranks that write
            parameters (and, on a tensor-parallel rank, by those that write optimizer state: the slices' shapes).
        trainable: Names of trained parameters.
        update: The rank's :class:`~ortflow.trainer.optim.Update` (segments, flat state, step count).
        optimizer: Config name of the rule ("adamw/torch", "sgd", ...), recorded and checked on load.
        rank: This rank.
        world_size: Ranks.
        sharded: True under ZeRO-1 (each rank writes its own optimizer file).
        replica: True when every rank holds whole-model state of its own (Adasum's per-rank optimizers): each rank
            writes its own file too, marked ``replica``, and on resume each rank reads one file whole.
        extra_state: Returns small named arrays/scalars to keep (the mixed-precision loss scaler), or None.
        stage: ``(index, count)`` on a pipeline rank: its stage's parameters and optimizer state go to the stage's
            own files, written by the stage's first replica (``rank`` is then the replica, ``world_size`` their count).
        tp: ``(tp rank, tp size, {sliced name: (axis, parts)})`` on a tensor-parallel rank: its slices (and the
            replicated parameters) go to its own files (:mod:`ortflow.checkpoints.tp`), written by its first replica
            (and its optimizer state, under ZeRO-1 and Adasum's deltas, by each replica).
    """

    parameters: Callable[[], dict[str, np.ndarray]]
    trainable: list[str]
    update: object
    optimizer: str
    rank: int = 0
    world_size: int = 1
    sharded: bool = False
    replica: bool = False
    extra_state: Callable[[], dict[str, np.ndarray | float | int]] | None = field(default=None)
    stage: tuple[int, int] | None = None
    tp: tuple[int, int, dict] | None = None


def write_state(state: TrainState, folder: Path) -> None:
    """Write this rank's files of a checkpoint into ``folder`` (the :class:`CheckpointManager` writer)."""
    if state.tp is not None:  # a tensor-parallel rank: its slices' files, as a stage's (each replica's optimizer
        t, size, slicing = state.tp  # state under ZeRO-1 and Adasum's deltas, else the first replica's)
        own = state.sharded or state.replica
        if state.rank != 0 and not own:
            return
        params = state.parameters()
        marks = {n: (int(a), parts_of(p), size, params[n].shape) for n, (a, p) in slicing.items()
                 if n in params}
        if state.rank == 0:
            write_params(folder / tpfiles.tp_file("params", t, size, state.stage), params, set(state.trainable),
                         marks=marks)
        name = (tpfiles.tp_shard_file(t, size, state.stage, state.rank, state.world_size) if own
                else tpfiles.tp_file("optimizer", t, size, state.stage))
        write_optimizer(folder / name, state, marks=marks)
        return
    if state.stage is not None:  # a pipeline stage: its first replica writes the stage's files
        index, count = state.stage
        if state.rank == 0:
            write_params(folder / stage_file("params", index, count), state.parameters(), set(state.trainable),
                         state.extra_state() if state.extra_state else None)
        if state.sharded or state.replica:  # each replica its shard (ZeRO-1) or its own state (Adasum's deltas)
            write_optimizer(folder / stage_shard_file(index, count, state.rank, state.world_size), state)
        elif state.rank == 0:
            write_optimizer(folder / stage_file("optimizer", index, count), state)
        return
    if state.rank == 0:
        write_params(folder / PARAMS_FILE, state.parameters(), set(state.trainable),
                     state.extra_state() if state.extra_state else None)
    if state.sharded or state.replica:
        write_optimizer(folder / shard_file(state.rank, state.world_size), state)
    elif state.rank == 0:
        write_optimizer(folder / OPTIMIZER_FILE, state)


def write_params(path: Path, params: dict[str, np.ndarray], trainable: set[str], extra: dict | None = None,
                 marks: dict | None = None) -> None:
    """``params.h5``: one dataset per parameter (and the extra state); ``marks``: tensor-parallel slicing."""
    with h5_file(path, "w") as f:
        group = f.create_group("parameters")
        for name in sorted(params):
            ds = group.create_dataset(escape(name), data=np.asarray(params[name], dtype=np.float32))
            ds.attrs["name"] = name
            ds.attrs["requires_grad"] = name in trainable
            tpfiles.mark(ds, (marks or {}).get(name))
        if extra:
            eg = f.create_group("extra_state")
            for key, value in extra.items():
                eg.create_dataset(escape(key), data=np.asarray(value)).attrs["name"] = key


def write_optimizer(path: Path, state: TrainState, marks: dict | None = None) -> None:
    """One optimizer-state file: every segment of every state of this rank."""
    update = state.update
    if hasattr(update, "to_host"):  # a device update: its state into the host mirrors first
        update.to_host()
    with h5_file(path, "w") as f:
        f.attrs["step_count"] = update.step_count
        f.attrs["optimizer"] = state.optimizer
        f.attrs["rank"], f.attrs["world_size"] = state.rank, state.world_size
        f.attrs["replica"] = state.replica
        if getattr(update, "groups_record", None):  # optimizer.groups: patterns and settings, and who is in each
            f.attrs["groups"] = update.groups_record
            f.attrs["group_members"] = update.groups_members
        for k, sname in enumerate(update.rule.state_names):
            group = f.create_group(sname)
            for i, seg in enumerate(update.segments):
                ds = group.create_dataset(escape(seg.name), data=update.state_views(i)[k])
                ds.attrs.update({"name": seg.name, "lo": seg.lo, "hi": seg.hi, "numel": seg.numel})
                tpfiles.mark(ds, (marks or {}).get(seg.name))


def _open(path: Path):
    try:
        return h5_file(path, "r")
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read as HDF5 ({err}); the checkpoint is damaged") from None


def params_files(folder: Path) -> list[Path]:
    """The parameter files of a format 2 folder: ``params.h5``, or a pipeline run's one per stage."""
    folder = Path(folder)
    if (folder / PARAMS_FILE).exists():
        return [folder / PARAMS_FILE]
    return tpfiles.tp_files(folder, "params") or sorted(folder.glob("params-stage*.h5"))


def read_params(folder: Path, names: set[str] | None = None) -> dict[str, np.ndarray]:
    """Parameters of a checkpoint folder by ONNX name (format 2 ``params.h5`` or the stages' files stitched, or a
    format 1 engine file); ``names`` reads only those (a pipeline stage's own)."""
    folder = Path(folder)
    files = params_files(folder)
    if not files and (folder / CHECKPOINT_FILE).exists():
        from ortflow.checkpoints.legacy import read_engine_checkpoint

        values = read_engine_checkpoint(folder / CHECKPOINT_FILE).parameters
        return values if names is None else {n: v for n, v in values.items() if n in names}
    if not files:
        raise CheckpointError(f"{folder} holds no parameters (params.h5); the checkpoint is incomplete")
    if "-tp" in files[0].name:  # tensor-parallel slices (of every pipeline stage): whole tensors rebuilt
        return tpfiles.read_merged_params(files, names)
    values: dict[str, np.ndarray] = {}
    for path in files:
        with _open(path) as f:
            for ds in f["parameters"].values():
                name = ds.attrs["name"]
                if name not in values and (names is None or name in names):  # a tied copy: the first holder's
                    values[name] = ds[()]
    return values


def read_extra_state(folder: Path) -> dict[str, np.ndarray]:
    """The ``extra_state`` saved with a checkpoint ({} if none)."""
    files = params_files(folder)
    if not files:
        return {}
    with _open(files[0]) as f:
        return {ds.attrs["name"]: ds[()] for ds in f["extra_state"].values()} if "extra_state" in f else {}


def optimizer_files(folder: Path) -> list[Path]:
    """The optimizer-state files of a format 2 folder (one, or one per rank that wrote it)."""
    return sorted(Path(folder).glob("optimizer*.h5"))


def _replica_choice(files: list[Path], rank: int) -> list[Path]:
    """Per-rank (replica) states: rank r reads file r modulo their number; sharded files are all read together."""
    with _open(files[0]) as f:
        replica = bool(f.attrs.get("replica", False))
    if not replica:
        return files
    if len(files) > 1:
        log.info("per-rank optimizer states: rank %d resumes from %s", rank, files[rank % len(files)].name)
    return [files[rank % len(files)]]


def state_pieces(
    folder: Path, rank: int = 0, names: set[str] | None = None, files: list[Path] | None = None
) -> tuple[int, str | None, dict[str, list[tuple[str, int, int, np.ndarray]]]]:
    """Step count, optimizer name and every state piece ``(name, lo, hi, values)`` by state name; ``names``: only
    those parameters'. A piece stored twice (a tied parameter in two pipeline stages' files) is read once."""
    folder = Path(folder)
    if not params_files(folder) and (folder / CHECKPOINT_FILE).exists():
        from ortflow.checkpoints.legacy import read_engine_checkpoint

        legacy = read_engine_checkpoint(folder / CHECKPOINT_FILE)
        log.warning("%s is a format 1 (engine) checkpoint: its AdamW moments are converted; the next checkpoint "
                    "is written in HDF5 (format 2)", folder.name)
        pieces = {
            s: [(n, 0, a.size, a.reshape(-1)) for n, a in arrays.items()] for s, arrays in legacy.optimizer.items()
        }
        return legacy.step, "adamw/engine" if pieces else None, pieces
    if files is None and tpfiles.tp_files(folder, "optimizer"):  # every tp rank's slices, whole tensors rebuilt
        return tpfiles.merged_optimizer_pieces(tpfiles.tp_files(folder, "optimizer"))
    files = files or optimizer_files(folder)
    if not files:
        raise CheckpointError(f"{folder} holds no optimizer state (optimizer*.h5); the checkpoint is incomplete")
    files = _replica_choice(files, rank)
    step, name, pieces, seen = None, None, {}, set()
    for path in files:
        with _open(path) as f:
            step, name = int(f.attrs["step_count"]), str(f.attrs["optimizer"])
            for sname, group in f.items():
                for ds in group.values():
                    a = ds.attrs
                    key = (sname, a["name"], int(a["lo"]), int(a["hi"]))
                    if key in seen or (names is not None and a["name"] not in names):
                        continue
                    seen.add(key)
                    pieces.setdefault(sname, []).append((a["name"], int(a["lo"]), int(a["hi"]), ds[()]))
    return step, name, pieces


def _check_groups(folder: Path, update, files: list[Path] | None) -> None:
    """Warn when the checkpoint's parameter groups differ from the run's (the state is per element: it still loads)."""
    files = files or optimizer_files(folder)
    if not files:
        return
    with _open(files[0]) as f:
        saved = f.attrs.get("groups")
    mine = getattr(update, "groups_record", None)
    if saved is not None and mine is not None and str(saved) != mine:
        log.warning("%s was written with other optimizer.groups; continuing with this run's groups", folder.name)
    elif (saved is None) != (mine is None):
        log.warning("%s was written %s optimizer.groups; continuing %s them", folder.name,
                    "without" if saved is None else "with", "with" if mine is not None else "without")


def state_refusal(folder: Path, saved: set[str], written_by: str | None, optimizer: str,
                  wanted: tuple[str, ...]) -> str | None:
    """Why optimizer ``optimizer``, which keeps ``wanted``, cannot resume the state ``saved`` that ``written_by`` left
    in checkpoint ``folder`` (None when it can)."""
    if not wanted or not set(wanted) - saved:
        return None
    writer = str(written_by or "").partition("/")[0] or "that wrote it"  # the optimizer.name to resume with
    return (f"{folder.name} holds optimizer state {sorted(saved)} (written by {written_by}) but optimizer "
            f"{optimizer} needs {list(wanted)}: resume with optimizer {writer}, "
            f"or start from its weights with a fresh {optimizer} state (at step 0) with checkpoint.init_from: "
            f"{folder} in a new run (another output_dir, or a checkpoint.dir without checkpoints)")


def saved_state(folder: Path) -> tuple[str | None, set[str]] | None:
    """The optimizer that wrote a format 2 checkpoint's state and the state names it holds, read from its first
    optimizer file's attributes and group names (no state is read); None for a folder without one (format 1)."""
    files = tpfiles.tp_files(folder, "optimizer") or optimizer_files(folder)
    if not files:
        return None
    with _open(files[0]) as f:
        return str(f.attrs.get("optimizer", "")) or None, {name for name, group in f.items() if len(group)}


def load_optimizer(folder: Path, update, optimizer: str, rank: int = 0, files: list[Path] | None = None) -> None:
    """Fill ``update``'s state (any sharding) and step count from a checkpoint's optimizer files (any sharding).

    Raises:
        CheckpointError: the state names differ (another optimizer wrote it) or an element is not covered.
    """
    step, written_by, pieces = state_pieces(folder, rank, {seg.name for seg in update.segments} or None, files)
    wanted = update.rule.state_names
    refusal = state_refusal(folder, set(pieces), written_by, optimizer, wanted)
    if refusal:
        raise CheckpointError(refusal)
    if written_by and written_by != optimizer:
        fix = " (set optimizer.rule: engine to continue it bit for bit)" if written_by == "adamw/engine" else ""
        log.warning("%s was written by optimizer %s; continuing with %s%s", folder.name, written_by, optimizer, fix)
    for k, sname in enumerate(wanted):
        by_name: dict[str, list] = {}
        for piece in pieces[sname]:
            by_name.setdefault(piece[0], []).append(piece)
        for i, seg in enumerate(update.segments):
            target, covered = update.state_views(i)[k], 0
            for _, lo, hi, values in by_name.get(seg.name, ()):
                a, b = max(lo, seg.lo), min(hi, seg.hi)
                if a < b:
                    target[a - seg.lo : b - seg.lo] = values[a - lo : b - lo]
                    covered += b - a
            if covered != seg.size:
                raise CheckpointError(
                    f"{folder.name}: optimizer state {sname} of {seg.name} covers {covered} of {seg.size} elements "
                    "(a shard file is missing or the model changed); use another checkpoint"
                )
    update.step_count = step
    _check_groups(folder, update, files)
    if hasattr(update, "to_device"):
        update.to_device()
