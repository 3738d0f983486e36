"""A one-process simulation of the tensor-parallel split (no MPI: the ranks' all-reduce is a sum here).

:func:`run_pieces` runs the forward of the pieces of a model (the GPTs of :mod:`tests.support.gpt`, the real exports)
in inference sessions; :func:`piece_gradients` runs one micro-batch forward and backward through the engine artifacts
``ortflow configure`` built for every tensor-parallel rank, as :mod:`ortflow.trainer.parallel.tensor_parallel_body`
does on ``tp`` ranks, and :func:`whole_gradients` through the unsplit artifacts, so the two can be compared parameter by
parameter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ortflow.artifacts_folder import GRAD_IN_SUFFIX, piece_dir, read_tensor_record
from ortflow.engine import api
from ortflow.graph.tensor_parallel.tensor_pieces import cut_pieces
from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_split import plan_tensor_parallel_split
from ortflow.tensor_slices import merge_slices


def trainable(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]


def run_pieces(model: onnx.ModelProto, size: int, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's first output computed by ``size`` simulated ranks, piece by piece, partial sums added in rank
    order (what the all-reduce does; a parallel piece's replicated sends are each rank's own)."""
    names = trainable(model)
    plan = plan_tensor_parallel_split(model, names, size)
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
        partial = ranks[0][k].partial_sends
        if partial:
            summed = {n: sum(o[n] for o in outs[1:]) + outs[0][n] for n in partial}
            outs = [{**o, **summed} for o in outs]
        for r in range(size):
            envs[r].update(outs[r])
    return envs[0][model.graph.output[0].name]


def run_whole(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options).run(None, feeds)[0]


def _call(module, train: bool, feeds: dict[str, np.ndarray]) -> list:
    module.train() if train else module.eval()
    outputs = module(*(feeds[n] for n in module.input_names()))
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _gradients(states) -> dict[str, np.ndarray]:
    """Trained parameters' gradients, summed over the states holding them (a tied weight's pieces)."""
    out: dict[str, np.ndarray] = {}
    for state in states:
        for name, param in state.parameters:
            if param.requires_grad:
                out[name] = out[name] + param.grad if name in out else np.array(param.grad)
    return out


def whole_gradients(artifacts_dir: Path, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and parameter gradients of one micro-batch through a run's unsplit artifacts."""
    state = api.CheckpointState.load_checkpoint(str(artifacts_dir / "checkpoint"))
    module = api.Module(str(artifacts_dir / "training_model.onnx"), state, str(artifacts_dir / "eval_model.onnx"),
                        device="cpu")
    loss = float(_call(module, True, batch)[0])
    return loss, _gradients([state])


def _rank_sum(values: list[np.ndarray]) -> np.ndarray:
    total = np.array(values[0])
    for v in values[1:]:
        total = total + v
    return total


def piece_gradients(artifacts_dir: Path, batch: dict[str, np.ndarray]) -> tuple[list[float], dict[str, np.ndarray],
                                                                                 dict[str, list[np.ndarray]]]:
    """One micro-batch through the tensor pieces a run's configure built for its ``hp`` ranks, ranks one after
    another: the forward with the eval models (a parallel piece's partial sums summed over the ranks in rank order),
    then the training calls in reverse, driven by the gradients of what each piece sent (a parallel piece's
    replicated sends' divided by the size), a parallel piece's input gradients and its replicated parameters'
    gradients summed over the ranks.

    Returns:
        Each rank's loss; each trained parameter's gradient as the whole model's (slices merged along their split
        axis, a replicated parameter's from rank 0); each replicated parameter's gradient on every rank.
    """
    record = read_tensor_record(artifacts_dir)
    size, infos = record["size"], record["pieces"]
    ranks = []
    for r in range(size):
        pieces = []
        for info in infos:
            folder = piece_dir(artifacts_dir, r, info["index"])
            state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
            pieces.append((state, api.Module(str(folder / "training_model.onnx"), state,
                                             str(folder / "eval_model.onnx"), device="cpu")))
        ranks.append(pieces)
    envs = [dict(batch) for _ in range(size)]
    for k, info in enumerate(infos[:-1]):
        outs = [_call(ranks[r][k][1], False, envs[r])[: len(info["sends"])] for r in range(size)]
        partial = info["partial_sends"]
        outs = [[_rank_sum([o[j] for o in outs]) if n in partial else outs[r][j] for j, n in enumerate(info["sends"])]
                for r in range(size)]
        for r in range(size):
            envs[r].update(zip(info["sends"], outs[r], strict=True))
    grads: list[dict[str, np.ndarray]] = [{} for _ in range(size)]
    losses = []
    for k in reversed(range(len(infos))):
        info, last = infos[k], k == len(infos) - 1
        backs = []
        for r in range(size):
            scale = {n: np.float32(1 / size) if info["parallel"] and n not in info["partial_sends"] else np.float32(1)
                     for n in info["float_sends"]}
            feeds = envs[r] if last else {**envs[r], **{n + GRAD_IN_SUFFIX: grads[r].get(n, np.zeros_like(envs[r][n]))
                                                        * scale[n] for n in info["float_sends"]}}
            outputs = _call(ranks[r][k][1], True, feeds)
            if last:
                losses.append(float(outputs[0]))
            backs.append(outputs[1 : 1 + len(info["float_receives"])])
        if info["parallel"]:
            backs = [[_rank_sum([b[j] for b in backs]) for j in range(len(info["float_receives"]))]] * size
        for r in range(size):
            for name, g in zip(info["float_receives"], backs[r], strict=True):
                grads[r][name] = grads[r][name] + g if name in grads[r] else np.array(g)
    for k, info in enumerate(infos):
        for name in info["replicated_parameters"]:
            params = [ranks[r][k][0].parameters[name] for r in range(size)]
            if params[0].requires_grad:
                total = _rank_sum([p.grad for p in params])
                for p in params:
                    p.grad[...] = total
    per_rank = [_gradients(state for state, _ in pieces) for pieces in ranks]
    slicing = record["slicing"]
    merged = {n: merge_slices([p[n] for p in per_rank], *slicing[n]) if n in slicing else g
              for n, g in per_rank[0].items()}
    replicated = {n: [p[n] for p in per_rank] for n in per_rank[0] if n not in slicing}
    return losses, merged, replicated
