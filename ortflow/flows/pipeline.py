"""The flows: lists of task calls, nothing else (each stage's logic lives in its plain function)."""

from __future__ import annotations

from prefect import flow

from ortflow import tasks
from ortflow.config import RunConfig


@flow(name="train-pipeline", log_prints=True)
def train_pipeline(config: RunConfig) -> dict:
    """Configure, prepare the data, train under mpiexec, keep the best checkpoints, export, and publish a summary.

    Stages whose inputs and outputs are unchanged return their cached result; a failed training resumes from its
    last complete checkpoint.

    Args:
        config: The whole run config (a deployment's parameters are validated against it).

    Returns:
        The summary: steps, final and best eval loss, throughput, kept checkpoints, exported model path.
    """
    tasks.configure(config)
    tasks.prepare_data(config)
    tasks.train(config)
    index = tasks.retain_checkpoints(config)
    exported = tasks.export(config)
    return tasks.publish_summary(config, index, exported)


@flow(name="export-only", log_prints=True)
def export_only(
    checkpoint: str,
    output: str,
    outputs: list[str] | None = None,
    optimize: bool = False,
    quantize: bool = False,
    tolerance: float = 1e-4,
) -> dict:
    """Export an existing checkpoint (a ``step-N`` folder, or a run folder for its best one) to an ONNX model.

    Args:
        checkpoint: Checkpoint folder or run folder.
        output: Path of the inference model to write.
        outputs: Graph outputs to keep (default: the model's original outputs).
        optimize: Apply ONNX Runtime's offline graph optimization.
        quantize: Dynamic int8 quantization.
        tolerance: Largest absolute difference to the eval graph that verification accepts.

    Returns:
        The export record: path, source checkpoint and step, verification numbers.
    """
    return tasks.export_checkpoint(checkpoint, output, tuple(outputs or ()), optimize, quantize, tolerance)
