"""Helpers shared by the pipeline, tensor-parallel and pp x hp MPI tests: the 2-layer GPT run, reading what the ranks
logged and wrote, killing a job after its first checkpoint, and checking an export against the unsplit eval graph."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from ortflow.checkpoints import list_complete
from tests.support.runs import make_run, rank_command, text_corpus

SEQ = 16
TRAIN = {"batch_size": 2, "num_train_steps": 8, "gradient_accumulation_steps": 2, "evaluation_period": 2,
         "display_loss_steps": 1, "max_eval_rows": 4}


#: A checkpoint after every update, all kept (the runs compared bit for bit with a killed and resumed one).
EVERY = {"period": 1, "max_num_checkpoints": 10}


def corpus(root: Path) -> Path:
    """The text the GPT runs train on (tests/fixtures/corpus.txt), copied once under ``root``."""
    return text_corpus(root)


def gpt_run(root: Path, name: str, model_path: Path | None = None, **sections):
    """A run on a 2-layer GPT (d_model 32, 4 heads; or the model at ``model_path``) over the test corpus."""
    from ortflow.examples.gpt import build_gpt

    model = model_path or root / "gpt2l.onnx"
    if not model.exists():
        build_gpt(model, seq_len=SEQ, d_model=32, num_layers=2, num_heads=4)
    data = {"train": [str(corpus(root))], "format": "text", "text": {"seq_len": SEQ}, "eval_fraction": 0.05}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=model, data=data, train=train, optimizer=optimizer, **sections)


def newest(cfg) -> Path:
    """The newest complete checkpoint folder of a run."""
    return list_complete(cfg.checkpoints_dir)[-1].path


def losses(output: str) -> list[float]:
    """The training losses rank 0 logged, in order."""
    return [float(x) for x in re.findall(r"\] \S+ INFO step \d+/\d+ \| loss ([0-9.e+-]+)", output)]


def initial_parameters(cfg) -> dict[str, np.ndarray]:
    """The user's model's initializers (the weights training starts from)."""
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(cfg.model.path)).graph.initializer}


def h5_arrays(path: Path) -> dict[str, bytes]:
    """Every dataset of an HDF5 file, as raw bytes (for bit-for-bit comparisons)."""
    import h5py

    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()].tobytes()) if isinstance(obj, h5py.Dataset)
                     else None)
    return found


def kill_after_first_checkpoint(cfg, wait_s: float = 120) -> list[int]:
    """Start the run's ranks, SIGKILL the job as soon as one checkpoint is complete; returns the complete steps."""
    proc = subprocess.Popen(rank_command(cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + wait_s
    while not list_complete(cfg.checkpoints_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # killed mid-run: no chance to save
    proc.wait(timeout=60)
    return [c.step for c in list_complete(cfg.checkpoints_dir)]


def assert_export_equals_eval_graph(cfg, exported: Path, params: dict[str, np.ndarray], seq: int = SEQ) -> None:
    """The exported model's logits equal, bit for bit, the unsplit eval graph's fed with ``params``."""
    import onnx
    import onnxruntime as ort

    from ortflow.graph.exports.gelu import decompose_gelu

    # The export writes fused GELUs back as standard ops (graph/exports/gelu.py): compare with the eval graph written
    # alike.
    eval_proto = decompose_gelu(onnx.load(str(cfg.artifacts_dir / "eval_model.onnx")))
    eval_proto.graph.output.append(onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None))
    ids = np.random.default_rng(0).integers(0, 256, (2, seq))
    names = [i.name for i in eval_proto.graph.input]
    feeds = {n: params[n] for n in names if n in params}
    feeds.update({n: ids for n in names if n == "input_ids"})
    feeds.update({n: np.zeros(2 * seq, np.int64) for n in names if n == "labels"})
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # fusions at ALL round differently
    reference = ort.InferenceSession(eval_proto.SerializeToString(), options).run(["logits"], feeds)[0]
    logits = ort.InferenceSession(str(exported), options).run(["logits"], {"input_ids": ids})[0]
    np.testing.assert_array_equal(logits, reference)
