"""The sections that say what to train on: the model and its loss, the data, the loop's counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ortflow.config.base import LossName, Section, is_remote, local_path, resolve_path, url_problem


class ModelConfig(Section):
    """The user's ONNX model and how it is turned into a training graph."""

    path: Path = Field(description="Path to the ONNX model to train (the reference's model_path).")
    loss: LossName = Field(
        "cross_entropy",
        description="Loss added by the engine: cross_entropy, mse, bce_with_logits, l1; or model_output when the "
        "model already outputs a scalar loss.",
    )
    loss_output: str | None = Field(
        None,
        description="Model output fed to the loss (default: the first output). With loss=model_output, the output "
        "that holds the loss.",
    )
    label_input: str = Field(
        "labels",
        description="Name of the label/target input the loss adds (cross_entropy: int64 labels [N] for scores "
        "[N, C], [B, T] for logits [B, T, V]).",
    )
    frozen: tuple[str, ...] = Field(
        (),
        description="fnmatch patterns of float initializers that are not trained (default: all float initializers "
        "are trained).",
    )
    ignore_index: int | None = Field(
        None,
        ge=-(2**31),
        lt=2**31,
        description="cross_entropy: the one label value the loss skips (e.g. -100 for padding). Any other label "
        "outside [0, classes) is refused by prepare-data.",
    )
    fuse_gelu: bool = Field(
        True,
        description="Replace the elementwise GELU an exporter writes (erf or tanh form) by the engine's one-kernel "
        "Gelu / FastGelu before training (docs/your-model.md); on CPU ranks the tanh form becomes "
        "x * sigmoid(x * (a + b x^2)) instead, the same function with a faster CPU gradient "
        "(docs/engine.md). The export writes it back as standard ops. Applies in fp32, fp16 and bf16.",
    )
    pipeline_cuts: tuple[str, ...] = Field(
        (),
        description="With distributed.pipeline_parallel_size P > 1: the P-1 tensor names where the model is cut into "
        "stages, in graph order (default: chosen to balance the stages' compute; docs/layouts.md).",
    )

    _resolve_path = field_validator("path", mode="after")(resolve_path)


SourceFormat = Literal["auto", "parquet", "csv", "arrow", "jsonl", "npz", "text"]


class TextConfig(Section):
    """How a plain-text corpus becomes fixed-length token windows."""

    seq_len: int = Field(128, gt=1, description="Tokens per window; inputs and labels are shifted by one token.")
    tokenizer: Path | None = Field(
        None,
        description="A Hugging Face `tokenizers` JSON file (a model's tokenizer.json; the `text` extra), whose ids "
        "must fit the model's embedding table; default: byte-level (vocabulary of 256).",
    )
    input_name: str = Field("input_ids", description="Model input that receives the token window.")
    label_name: str = Field("labels", description="Input that receives the next-token targets.")

    _resolve_path = field_validator("tokenizer", mode="after")(resolve_path)


class DataConfig(Section):
    """Training and evaluation data (the reference's train_data_dir / test_data_dir) and how it is sharded."""

    train: tuple[str, ...] = Field(
        description="Training source(s): files or glob patterns (relative ones resolve against the config's folder)."
    )
    test: tuple[str, ...] = Field(
        (), description="Evaluation source(s); when empty, eval_fraction of the training rows is held out."
    )
    format: SourceFormat = Field("auto", description="Source format; auto picks it from the file extension.")
    columns: dict[str, str | tuple[str, ...]] = Field(
        {},
        description="Model input name -> source column, list of columns, or glob pattern ('f*', natural order f0, "
        "f1, ..., f10); several columns of one value each are stacked into one [k] row (default: the column named "
        "like the input).",
    )
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of rows held out for eval when test is empty.")
    rows_per_shard: int = Field(65536, gt=0, description="Rows per Arrow shard file (the last may be short).")
    text: TextConfig = Field(TextConfig(), description="Settings for format=text corpora.")
    memory_budget_mb: int = Field(256, gt=0, description="Memory the sharder and loader may use for buffers.")
    prefetch_batches: int = Field(2, ge=0, description="Batches the loader prepares ahead in a background thread.")

    @field_validator("train", "test", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        value = (value,) if isinstance(value, (str, Path)) else value
        if isinstance(value, (list, tuple)) and any(isinstance(v, str) and not v.strip() for v in value):
            raise ValueError(
                "an entry is empty (an unset environment variable in a deployment's template?); give a file or glob"
            )
        return value

    @field_validator("train", "test", mode="after")
    @classmethod
    def _resolve_sources(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # Object-store URLs (s3://, gs://, az://) are read where they are; file:// URLs are local paths.
        for v in value:
            problem = url_problem(v, info.field_name and f"data.{info.field_name}", remote_ok=True)
            if problem:
                raise ValueError(problem)
        return tuple(v if is_remote(v) else str(resolve_path(Path(local_path(v)), info)) for v in value)

    @field_validator("train", mode="after")
    @classmethod
    def _train_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("give at least one training file or glob pattern")
        return value


class TrainConfig(Section):
    """Loop hyper-parameters. Steps are micro-batches, as in the reference; weight updates = steps / accumulation."""

    batch_size: int = Field(gt=0, le=2**24, description="Samples per micro-batch per rank.")
    eval_batch_size: int | None = Field(
        None, gt=0, le=2**24,
        description="Samples per eval batch (default: the model's fixed batch dim if it has one, else "
        "batch_size as written, also with global_batch_size); each rank evaluates whole batches, the same on any "
        "number of ranks."
    )
    num_train_steps: int = Field(
        gt=0, description="Forward/backward passes per rank; must be a multiple of gradient_accumulation_steps."
    )
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches summed before each weight update.")
    global_batch_size: int | None = Field(
        None, gt=0,
        description="Samples per weight update on any layout: per-rank batch (<= batch_size) and accumulation are "
        "derived from the ranks; num_train_steps then counts weight updates (leave gradient_accumulation_steps 1).",
    )
    display_loss_steps: int = Field(10, gt=0, description="Show the loss (mean over ranks) every this many updates.")
    evaluation_period: int = Field(
        100, ge=0, description="Evaluate every this many weight updates (0: only at the end)."
    )
    max_eval_rows: int | None = Field(
        None, gt=0,
        description="Evaluate only the first this many rows of the eval split, shared over the ranks: the same rows "
        "on any layout, and what `ortflow evaluate` uses (default: the whole split).",
    )
    batchnorm_variance: Literal["unbiased", "biased"] = Field(
        "unbiased",
        description="BatchNormalization running_var update: unbiased (torch: the batch variance times n / (n - 1), "
        "n values per channel) or biased (ONNX's rule, the engine's own).",
    )
    batchnorm_sync: Literal["broadcast", "average"] = Field(
        "broadcast",
        description="How the ranks' BatchNormalization running statistics become one before every eval and "
        "checkpoint: broadcast (rank 0's, as DistributedDataParallel's broadcast_buffers) or average (the mean over "
        "the data-parallel ranks; docs/training.md).",
    )
    seed: int = Field(0, ge=0, lt=2**31, description="Seed for shuffling and any randomness in the run.")
    profile_steps: tuple[int, int] | None = Field(
        None,
        description="Profile these weight updates [start, end] (1-based, inclusive, end at most the run's weight "
        "updates) with the engine's per-operator profiler: a Chrome trace per rank in <output_dir>/profile/ and a "
        "top-operators table.",
    )

    @property
    def num_weight_updates(self) -> int:
        """Optimizer steps in the whole run."""
        return self.num_train_steps // self.gradient_accumulation_steps

    @property
    def resolved_eval_batch_size(self) -> int:
        """eval_batch_size, defaulting to batch_size."""
        return self.eval_batch_size or self.batch_size

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_eval_batches" in data:
            raise ValueError("train.max_eval_batches counted batches per rank, so the eval rows changed with the "
                             "layout; use train.max_eval_rows: N (the first N rows of the eval split, on any layout)")
        return data

    @model_validator(mode="after")
    def _steps_multiple(self) -> TrainConfig:
        if self.profile_steps and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(f"train.profile_steps {list(self.profile_steps)}: need [start, end], 1 <= start <= end")
        if self.global_batch_size and self.gradient_accumulation_steps != 1:
            raise ValueError(
                "train.gradient_accumulation_steps is derived from train.global_batch_size and the ranks: leave it "
                "at 1 (or unset global_batch_size)"
            )
        if self.num_train_steps % self.gradient_accumulation_steps:
            k = self.gradient_accumulation_steps
            lower = self.num_train_steps // k * k
            raise ValueError(
                f"train.num_train_steps ({self.num_train_steps}) must be a multiple of "
                f"train.gradient_accumulation_steps ({k}); use {lower or k} or {lower + k}"
            )
        return self
