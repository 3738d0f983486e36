"""A one-process simulation of the tensor-parallel split (no MPI: the ranks' all-reduce is a sum here).

The models it runs are the GPTs of :mod:`tests.support.gpt`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from ortflow.graph.tensor_parallel import plan_tensor_split
from ortflow.graph.tensor_pieces import cut_pieces
from ortflow.graph.tensor_shard import shard_model


def trainable(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]


def run_pieces(model: onnx.ModelProto, size: int, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's first output computed by ``size`` simulated ranks, piece by piece, partial sums added in rank
    order (what the all-reduce does)."""
    names = trainable(model)
    plan = plan_tensor_split(model, names, size)
    ranks = [cut_pieces(shard_model(model, plan, r), plan, model, names) for r in range(size)]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    envs = [dict(feeds) for _ in range(size)]
    for k in range(len(ranks[0])):
        outs = []
        for r in range(size):
            stage = ranks[r][k].stage
            session = ort.InferenceSession(stage.model.SerializeToString(), options)
            values = session.run(list(stage.sends), {i.name: envs[r][i.name] for i in session.get_inputs()})
            outs.append(dict(zip(stage.sends, values, strict=True)))
        if ranks[0][k].parallel:
            summed = {n: sum(o[n] for o in outs[1:]) + outs[0][n] for n in outs[0]}
            outs = [summed] * size
        for r in range(size):
            envs[r].update(outs[r])
    return envs[0][model.graph.output[0].name]


def run_whole(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options).run(None, feeds)[0]

