"""The flows: lists of task calls, nothing else (each stage's logic lives in its plain function)."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.states import Completed

from ortflow import tasks
from ortflow.config import RunConfig

Stage = Literal["configure", "prepare_data", "train", "retain", "export"]


#: Hooks: a worker's flow-run process prints a failed stage as one line (no traceback), the process running the flow
#: run is recorded (a vanished one is found later), and the events ortflow's automations react to go out (a run
#: started, a run ended).
_ENDS = ("on_completion", "on_failure", "on_crashed", "on_cancellation")
_ANNOUNCE = {"on_running": [tasks.quiet_console, tasks.record_process, tasks.announce_state],
             **{key: [tasks.announce_state] for key in _ENDS}}


@flow(name="train-pipeline", log_prints=True, **_ANNOUNCE)
def train_pipeline(
    config: RunConfig | str,
    overrides: list[str] | None = None,
    from_stage: Stage | None = None,
    policy: Literal["retrain", "continue"] | None = None,
    skip_unchanged: bool | None = None,
    new_version: bool = False,
    wait_for_lock: bool | None = None,
    version: str | None = None,
) -> dict:
    """Configure, prepare the data, train under mpiexec, keep the best checkpoints, export, and publish a summary.

    Stages whose inputs and outputs are unchanged return their cached result; a failed training resumes from its
    last complete checkpoint. The flow run holds ``output_dir``'s lock throughout: a second run on the same folder is
    refused with the holder named (or waits, with ``wait_for_lock``).

    Args:
        config: The whole run config, or the path of a config file (relative to the flow run's working folder).
        overrides: ``--set``-style changes for this run only (``["train.num_train_steps=50"]``).
        from_stage: Rerun this stage and every later one (``ortflow run --from``); with ``new_version``, inside an
            existing version (``version``, else the newest), never a new one.
        policy: ``retrain`` or ``continue`` for this run (default: ``versions.policy``).
        skip_unchanged: Skip when config, model, data and policy are unchanged since the last version
            (default: config's).
        new_version: Train a new model version under ``output_dir/versions/`` (deployments set this).
        wait_for_lock: Wait for a busy run folder instead of failing (default: ``pipeline.wait_for_lock``).
        version: With ``from_stage`` and ``new_version``: the version whose stages rerun (default: the newest).

    Returns:
        The summary: version, steps, final and best eval loss, throughput, kept checkpoints, exported model path.
    """
    cfg = tasks.resolve_config(config, overrides, policy, skip_unchanged, wait_for_lock)
    with tasks.run_folder_lock(cfg, "pipeline"):
        plan = tasks.plan_version(cfg, new_version, from_stage, version, overrides)
        if plan.skipped_because:  # the flow run ends in a Completed state named Skipped, saying why
            return Completed(name="Skipped", message=f"skipped: {plan.skipped_because}",
                             data=tasks.publish_skipped(cfg, plan))
        run = plan.config
        try:
            if run.distributed.launcher == "slurm":  # a request Slurm refuses fails here, not after configure
                tasks.check_launcher(run)
            tasks.staged(tasks.configure, run)(run)
            tasks.staged(tasks.prepare_data, run)(run)
            tasks.staged(tasks.train, run)(run)
            index = tasks.staged(tasks.retain_checkpoints, run)(run)
            exported = tasks.staged(tasks.export, run)(run)
            summary = tasks.publish_summary(run, index, exported, plan.version)
        except Exception:
            tasks.record_version_end(cfg, plan, "failed")
            raise
        except BaseException:  # a stop signal or a cancellation: the ranks stopped with a stop checkpoint
            tasks.record_version_end(cfg, plan, "stopped")
            raise
        tasks.finish_version(cfg, plan, "completed", summary)
        if plan.version is not None:
            tasks.prune_versions(cfg)  # versions.keep
    return summary


@flow(name="export-only", log_prints=True, **_ANNOUNCE)
def export_only(
    checkpoint: str,
    output: str,
    outputs: list[str] | None = None,
    optimize: bool = False,
    quantize: bool = False,
    tolerance: float = 1e-4,
) -> dict:
    """Export an existing checkpoint (a ``step-N`` folder, a run folder or ``OUTPUT_DIR/latest`` for its best one).

    Args:
        checkpoint: Checkpoint folder, run folder, or OUTPUT_DIR/latest (the newest completed version).
        output: Path of the inference model to write.
        outputs: Graph outputs to keep (default: the model's original outputs).
        optimize: Apply ONNX Runtime's offline graph optimization.
        quantize: Dynamic int8 quantization.
        tolerance: Largest absolute difference to the eval graph that verification accepts.

    Returns:
        The export record: path, source checkpoint and step, verification numbers.
    """
    return tasks.export_checkpoint(checkpoint, output, tuple(outputs or ()), optimize, quantize, tolerance)
