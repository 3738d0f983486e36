"""What a run leaves behind and how it is run: checkpoints, TensorBoard, export, schedule, pipeline, versions."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ortflow.config.base import Section, resolve_path


class CheckpointConfig(Section):
    """Checkpoints: the reference's checkpoints_dir, checkpoint_period, max_num_checkpoints, checkpoint_to_load_path."""

    dir: Path | None = Field(None, description="Checkpoint folder (default: <output_dir>/checkpoints).")
    period: int = Field(100, ge=0, description="Save every this many weight updates (0: only the final one).")
    max_num_checkpoints: int = Field(3, gt=0, description="Newest complete checkpoints kept while training.")
    checkpoint_to_load_path: Path | None = Field(
        None, description="Resume from this checkpoint (default: the newest complete one in dir, if any)."
    )
    init_from: Path | None = Field(
        None, description="Warm start: a checkpoint folder whose weights training starts from at step 0 (the optimizer "
        "state starts fresh), unless dir already holds a checkpoint to resume. Set by versions.policy continue."
    )

    _resolve_paths = field_validator("dir", "checkpoint_to_load_path", "init_from", mode="after")(resolve_path)


class TensorBoardConfig(Section):
    """TensorBoard event files, written by rank 0."""

    log_dir: Path | None = Field(None, description="Event folder (default: <output_dir>/tensorboard).")
    scalar_names: tuple[str, ...] = Field(
        (
            "train/loss", "eval/loss", "train/learning_rate", "train/grad_norm", "train/samples_per_s",
            "train/tokens_per_s", "train/loss_scale", "train/skipped_updates", "time/data", "time/forward_backward",
            "time/comm", "time/comm_wait", "time/norm_clip", "time/update", "time/eval", "time/checkpoint",
            "time/other",
        ),
        description="Scalars to log; any subset of the default (time/*: each phase's share of the window's wall time).",
    )
    histogram_names: tuple[str, ...] = Field(
        (), description="fnmatch patterns of trained parameters whose histograms to log (each must match one)."
    )

    @field_validator("scalar_names", mode="after")
    @classmethod
    def _known_scalars(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        known = cls.model_fields["scalar_names"].default  # the default logs every scalar ortflow writes
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"unknown scalar(s) {unknown} would silently log nothing; choose from {list(known)}")
        return value

    _resolve_path = field_validator("log_dir", mode="after")(resolve_path)


class ExportConfig(Section):
    """The inference model made from a checkpoint."""

    path: Path | None = Field(None, description="Where to write the model (default: <output_dir>/export/model.onnx).")
    outputs: tuple[str, ...] = Field((), description="Graph outputs to keep (default: the model's original outputs).")
    optimize: bool = Field(False, description="Apply ONNX Runtime's offline graph optimization.")
    quantize: bool = Field(False, description="Dynamic int8 quantization, with the eval accuracy change reported.")
    tolerance: float = Field(1e-4, gt=0, description="Max abs difference to the eval graph accepted by verification.")
    precision: Literal["fp32", "compute"] = Field(
        "fp32", description="fp32, or the mixed-precision compute type (fp16/bf16 weights and activations)."
    )

    _resolve_path = field_validator("path", mode="after")(resolve_path)


class ScheduleConfig(Section):
    """When a served deployment runs the pipeline."""

    cron: str | None = Field(None, description="Cron expression, e.g. '0 3 * * *'.")
    interval_s: float | None = Field(None, gt=0, description="Seconds between runs.")
    timezone: str = Field("UTC", description="Timezone of the cron expression.")

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleConfig:
        if self.cron and self.interval_s:
            raise ValueError("schedule: set either cron or interval_s, not both")
        return self


class PipelineConfig(Section):
    """How the Prefect pipeline runs its stages: retries, timeouts, and waiting for a busy run folder."""

    retries: int = Field(2, ge=0, description="Retries of configure, prepare_data, retain and export after a crash or "
                         "I/O error (errors that would repeat are never retried).")
    retry_delays_s: tuple[float, ...] = Field(
        (2.0, 10.0), description="Seconds before each retry of those stages (the last value repeats)."
    )
    train_retries: int = Field(2, ge=0, description="Retries of the train stage; each resumes from the newest "
                               "complete checkpoint of its own run folder.")
    train_retry_delays_s: tuple[float, ...] = Field((5.0, 30.0), description="Seconds before each train retry.")
    stage_timeout_s: float | None = Field(
        None, gt=0, description="Time limit of configure, prepare_data, retain and export each (default: none)."
    )
    train_timeout_s: float | None = Field(
        None, gt=0, description="Time limit of one train attempt; the ranks are stopped when it passes (default: none)."
    )
    wait_for_lock: bool = Field(
        False, description="When another run holds the run folder, wait for it instead of failing at once."
    )
    lock_timeout_s: float | None = Field(
        None, gt=0, description="With wait_for_lock, fail after waiting this long (default: wait as long as it takes)."
    )


class VersionsConfig(Section):
    """Model versions: what a deployment or scheduled run (or `ortflow run --new-version`) trains."""

    policy: Literal["retrain", "continue"] = Field(
        "retrain", description="retrain: start from model.path's weights; continue: warm-start from the previous "
        "successful version's checkpoint, on the current data (refused when the model file or the model or optimizer "
        "sections changed)."
    )
    continue_from: Literal["final", "best"] = Field(
        "final", description="With policy continue: the previous version's final checkpoint or its best by eval loss."
    )
    skip_unchanged: bool = Field(
        False, description="Skip the run (recorded as skipped) when config, model, data and versions.policy are "
        "unchanged since the last successful version (a policy change always trains)."
    )
    keep: int | None = Field(
        None, ge=1, le=100000, description="Completed versions to keep (the newest ones; null keeps all). After a "
        "version completes, older completed versions and the failed or stopped ones older than them are deleted, "
        "except pinned versions, `latest`, and a version a running one warm-starts from; `ortflow runs --prune` "
        "does the same on demand."
    )
    pinned: tuple[str, ...] = Field(
        (), description="Version names that are never pruned (e.g. the one in production)."
    )
