"""``ortflow evaluate``: eval loss (and accuracy with cross_entropy) of any checkpoint of a run on its eval split.

The loss is the training engine's own eval graph run on the checkpoint's parameters, over the same batches and added
by the same rule as the trainer's evaluations (``EvalLoader.weighted_batches``: every row once, padded batches of
fixed-batch models corrected; :func:`~ortflow.dataprep.loader.mean_eval_loss`), so it is the eval loss training
records for the same checkpoint, digit for digit, where the training ranks ran the same arithmetic (a CPU data-parallel
run; GPU kernels and tensor-parallel slices add in other orders in float32). Accuracy (cross_entropy only) is the
share of labels equal to the argmax of the loss output over its last axis, counted per position for ``[B, T, V]``
logits; it comes from the inference graph cut out of the eval model (as export makes it).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

from ortflow.export.model import build_inference_model, label_names, load_parameters, resolve_source
from ortflow.export.verify import ExportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate_checkpoint` measured.

    Attributes:
        checkpoint: The checkpoint folder (the artifacts folder for ``initial``).
        step: Its step (0 for ``initial``).
        loss: Mean eval loss over the rows (None when the eval split is empty).
        accuracy: Share of correct argmax predictions (cross_entropy only, else None).
        num_rows: Eval rows evaluated.
    """

    checkpoint: str
    step: int
    loss: float | None
    accuracy: float | None
    num_rows: int

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def evaluate_checkpoint(source: Path, checkpoint: str | None = None, max_rows: int | None = None) -> Evaluation:
    """Evaluate a checkpoint of a configured, prepared run on its eval split (one process, CPU).

    Args:
        source: A run folder, or a checkpoint folder inside one.
        checkpoint: For a run folder: ``best``, ``latest``, ``initial``, ``step-N`` or ``N`` (default: best, else
            latest).
        max_rows: Evaluate the split's first this many rows (default: the run's ``train.max_eval_rows``, the rows
            its evaluations used; without it the whole split).

    Raises:
        ExportError: no run config, checkpoint, eval model or prepared eval data.
    """
    from ortflow.dataprep.loader import EvalLoader, mean_eval_loss
    from ortflow.engine import api

    src = resolve_source(Path(source), None, None, checkpoint)
    cfg = src.config
    if cfg is None or src.data_dir is None:
        raise ExportError(f"{source}: evaluate needs a configured run folder with prepared data (config.yaml, "
                          "data/manifest.json): run `ortflow configure` and `ortflow prepare-data` first")  # fmt: skip
    from ortflow.artifacts_folder import verify_artifacts
    from ortflow.config import eval_batch
    from ortflow.config.sealed import read_configure
    from ortflow.dataprep.loader import verify_data

    verify_artifacts(cfg.artifacts_dir, read_configure(cfg.output_dir))  # before the engine loads them
    verify_data(src.data_dir)  # and the shards against the manifest, as training does
    batch = eval_batch(cfg, cfg.output_dir)  # the ranks' eval batch: the same batches, the same float32 means
    max_rows = max_rows if max_rows is not None else cfg.train.max_eval_rows  # the rows training evaluated
    loader = EvalLoader(src.data_dir, batch, rank=0, world_size=1, max_rows=max_rows)
    # The engine's session starts from the configured weights; the checkpoint's values (HDF5, or a format 1 engine
    # file) are then copied into its parameter buffers by name.
    state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
    module = api.Module(str(cfg.artifacts_dir / "training_model.onnx"), state, str(src.eval_model), device="cpu")
    values = load_parameters(src.checkpoint.path)
    for name, param in state.parameters:
        param.data[...] = values[name]
    module.eval()
    names = module.input_names()
    sums = np.zeros((loader.num_batches, 2))
    for k, feeds, weight, real in loader.weighted_batches():
        sums[k] += (float(module(*(feeds[n] for n in names))) * weight, real)
    loss, rows = mean_eval_loss(sums), int(sums[:, 1].sum())
    accuracy = _accuracy(src, loader) if (src.record or {}).get("loss") == "cross_entropy" else None
    log.info("evaluated %s: loss %s, accuracy %s over %d rows", src.checkpoint.path, loss, accuracy, rows)
    return Evaluation(str(src.checkpoint.path), src.checkpoint.step, loss, accuracy, rows)


def _accuracy(src, loader) -> float | None:
    """Share of labels equal to the argmax of the loss output (per position for sequence outputs)."""
    record = src.record
    eval_proto = onnx.load(str(src.eval_model))
    labels = label_names(eval_proto, record, src.config)
    label, output = record["label_input"], record["loss_output"]
    model = build_inference_model(eval_proto, load_parameters(src.checkpoint.path), [output], labels)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    correct = counted = 0
    for feeds, real in loader.batches():
        scores = session.run([output], {n: feeds[n] for n in inputs})[0]
        fed = len(feeds[inputs[0]])  # rows fed (real, or the padded batch size)
        predicted = scores.reshape(fed, -1, scores.shape[-1]).argmax(axis=-1)[:real]
        truth = feeds[label].reshape(fed, -1)[:real]
        correct += int((predicted == truth).sum())
        counted += truth.size
    return correct / counted if counted else None
