"""Format 1 checkpoints: the engine's flatbuffers ``checkpoint`` file, read without the engine's session.

Before ortflow owned the update, a checkpoint folder held the engine's ``CheckpointState`` file with its AdamW
moments. It is read here with ONNX Runtime's generated flatbuffers classes (``ort_training_checkpoint.fbs``):
parameters from the module state, the moments (``momentum0`` = ``exp_avg``, ``momentum1`` = ``exp_avg_sq``, the same
quantities ortflow's AdamW keeps) and the step from the optimizer group. A run resumed from one continues with the
``engine`` rule bit for bit; its next checkpoint is written in format 2 (the conversion is logged once).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortflow.checkpoints.folder import CheckpointError

#: The engine's names for AdamW's moments, mapped to ortflow's state names.
MOMENTUM_NAMES = {"momentum0": "exp_avg", "momentum1": "exp_avg_sq"}


@dataclass
class LegacyState:
    """What a format 1 file holds."""

    parameters: dict[str, np.ndarray]
    trainable: list[str]
    optimizer: dict[str, dict[str, np.ndarray]]  # state name -> parameter name -> array
    step: int


def _fbs():
    import onnxruntime

    folder = Path(onnxruntime.__file__).parent / "tools" / "ort_format_model" / "ort_flatbuffers_py"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # where ONNX Runtime ships the generated classes (package `fbs`)
    return importlib.import_module("fbs.Checkpoint")


def _tensor(t) -> tuple[str, np.ndarray]:
    if t.DataType() != 1:  # TensorDataType.FLOAT
        raise CheckpointError(f"tensor {t.Name().decode()} of the engine checkpoint is not float32")
    dims = [int(d) for d in t.DimsAsNumpy()] if t.DimsLength() else []
    raw = t.RawDataAsNumpy()
    return t.Name().decode(), np.frombuffer(raw.tobytes(), dtype="<f4").reshape(dims).copy()


def read_engine_checkpoint(path: Path) -> LegacyState:
    """Parameters, AdamW moments and step of an engine ``checkpoint`` file.

    Raises:
        CheckpointError: the file is not an engine checkpoint or holds external data.
    """
    checkpoint_mod = _fbs()
    data = Path(path).read_bytes()
    if len(data) < 8 or data[4:8] != b"ODTC":
        raise CheckpointError(f"{path} is not an ONNX Runtime training checkpoint (no ODTC identifier)")
    root = checkpoint_mod.Checkpoint.GetRootAs(data, 0)
    module = root.ModuleState()
    if module.HasExternalData():
        raise CheckpointError(f"{path} keeps its tensors in external data, which ortflow cannot read")
    params, trainable = {}, []
    for j in range(module.RequiresGradParamsLength()):
        name, value = _tensor(module.RequiresGradParams(j))
        params[name] = value
        trainable.append(name)
    for j in range(module.FrozenParamsLength()):
        name, value = _tensor(module.FrozenParams(j))
        params[name] = value
    optimizer: dict[str, dict[str, np.ndarray]] = {}
    step = 0
    for g in range(root.OptimizerGroupsLength()):
        group = root.OptimizerGroups(g)
        step = int(group.Step())
        for s in range(group.OptimizerStatesLength()):
            pstate = group.OptimizerStates(s)
            pname = pstate.ParamName().decode()
            for m in range(pstate.MomentumsLength()):
                mname, value = _tensor(pstate.Momentums(m))
                optimizer.setdefault(MOMENTUM_NAMES.get(mname, mname), {})[pname] = value
    return LegacyState(params, sorted(trainable), optimizer, step)
