"""How a global batch splits over ranks: read by the launching process and by every rank."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ortflow.config.run import RunConfig

# --- How a global batch splits over ranks: read by the launching process and by every rank. ---


class LayoutError(ValueError):
    """No layout or batch split satisfies the constraints; the message names the field and valid choices."""


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits: per-rank micro-batch x accumulation steps x ranks = global batch."""

    batch_size: int
    accumulation: int
    ranks: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation * self.ranks

    def describe(self) -> str:
        """``2 replica(s) x 16 samples x 2 micro-batch(es) = 64 samples per update`` (the layout line of training)."""
        return (f"{self.ranks} replica(s) x {self.batch_size} samples x {self.accumulation} micro-batch(es) = "
                f"{self.global_batch} samples per update")


def divides(global_batch: int, ranks: int, unit: int) -> bool:
    """Whether ``ranks`` micro-batches of a multiple of ``unit`` can make up ``global_batch`` samples."""
    return global_batch % (ranks * unit) == 0


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The multiples of ``unit`` closest to ``value`` from below and above (one entry if value is one)."""
    below = value // unit * unit
    return [value] if below == value else [m for m in (below, below + unit) if m > 0]


def plan_batch(global_batch: int, ranks: int, max_batch: int, fixed_batch: int | None = None) -> BatchPlan:
    """Per-rank micro-batch and accumulation steps so that ranks x batch x steps = ``global_batch``.

    The micro-batch is the largest divisor of the rank's share that is <= ``max_batch`` (fewest accumulation
    steps), or exactly ``fixed_batch`` when the model's batch dim is fixed.

    Raises:
        LayoutError: naming the nearest global batch sizes and rank counts that work.
    """
    unit = fixed_batch or 1
    if global_batch % (ranks * unit):
        sizes = nearest_multiples(global_batch, ranks * unit)
        counts = [r for r in range(1, 2 * ranks + 1) if divides(global_batch, r, unit)]
        near = sorted(counts, key=lambda r: (abs(r - ranks), r))[:3]
        fixed = f" and the model's fixed batch dim {unit}" if fixed_batch else ""
        raise LayoutError(
            f"train.global_batch_size {global_batch} cannot be split over {ranks} rank(s){fixed}: use a global batch "
            f"of {' or '.join(map(str, sizes))}, or {' or '.join(map(str, sorted(near))) or 'no other'} rank(s)"
        )
    share = global_batch // ranks
    if fixed_batch:
        return BatchPlan(fixed_batch, share // fixed_batch, ranks)
    batch = next(b for b in range(min(max_batch, share), 0, -1) if share % b == 0)
    return BatchPlan(batch, share // batch, ranks)


def fixed_batch_dim(inputs: list[dict], merged_rows: dict[str, int] | None = None) -> int | None:
    """The model's fixed batch dim from configure.json's ``train_inputs`` (None when the batch dim is symbolic).

    Args:
        inputs: ``[{"name", "dtype", "shape"}]`` of the training model's inputs.
        merged_rows: For inputs whose batch and sequence dims the loader merges (a GPT's ``labels [B*T]``), the
            rows' leading dim ``T`` (from the data manifest); their fixed dim counts ``B*T`` values.
    """
    merged_rows = merged_rows or {}
    found = set()
    for item in inputs:
        shape = item.get("shape") or []
        if shape and isinstance(shape[0], int) and shape[0] > 0:
            per_row = merged_rows.get(item["name"], 1)
            found.add(shape[0] // per_row if shape[0] % per_row == 0 else shape[0])
    if len(found) > 1:
        raise LayoutError(f"model inputs fix different batch sizes {sorted(found)}; re-export with one batch dim")
    return found.pop() if found else None


@dataclass(frozen=True)
class RunFacts:
    """What the run folder says about the model: trainable parameters and a fixed batch dim."""

    num_parameters: int
    fixed_batch: int | None


def run_facts(run_dir: Path) -> RunFacts:
    """Model size and fixed batch dim from configure.json (and the data manifest's merged inputs, if prepared)."""
    run_dir = Path(run_dir)
    try:
        record = json.loads((run_dir / "configure.json").read_text())
    except (OSError, ValueError):
        raise LayoutError(f"{run_dir}/configure.json is missing: run `ortflow configure CONFIG` first") from None
    merged = {}
    try:
        manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
        merged = {i["name"]: i["row_shape"][0] for i in manifest.get("inputs", []) if i.get("merge_leading_dims")}
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return RunFacts(int(record.get("num_parameters", 0)), fixed_batch_dim(record.get("train_inputs", []), merged))


def fixed_batch_problems(cfg: RunConfig, run_dir: Path) -> list[str]:
    """Batch sizes of ``cfg`` that the model's fixed batch dim (configure.json) cannot take: the engine would fail at
    the first update or evaluation with a shape error.

    Raises:
        LayoutError: the folder is not configured, or its inputs fix different batch sizes.
    """
    fixed = run_facts(run_dir).fixed_batch
    train = cfg.train
    # A global batch is split into batches of the fixed size (plan_batch): only a per-rank one can miss it.
    sizes = {} if train.global_batch_size else {"train.batch_size": train.batch_size}
    if train.eval_batch_size is not None:
        sizes["train.eval_batch_size"] = train.eval_batch_size
    return [f"{field} {size} does not fit the model's fixed batch dim of {fixed} (configure.json 'batch' says why it "
            f"was kept): set {field} to {fixed}, or export the model with a dynamic batch dim and configure again"
            for field, size in sizes.items() if fixed is not None and size != fixed]


def eval_batch(cfg: RunConfig, run_dir: Path) -> int:
    """The eval batch of every evaluation of a run, the ranks' and ``ortflow evaluate``'s: ``train.eval_batch_size``,
    else the model's fixed batch dim (configure.json), else ``train.batch_size`` as written (also where
    ``train.global_batch_size`` derives the ranks' training batch), so the eval batches are the same on any layout."""
    train = cfg.train
    if train.eval_batch_size is not None:
        return train.eval_batch_size
    return run_facts(run_dir).fixed_batch or train.batch_size


def rank_config(cfg: RunConfig, world: int, run_dir: Path) -> RunConfig:
    """The config a rank trains with: with train.global_batch_size, the per-rank batch and accumulation for
    ``world`` ranks (run length in weight updates unchanged; the eval batch stays the config's, so evaluations form
    the batches ``ortflow evaluate`` forms on any number of ranks); otherwise ``cfg`` itself.

    Raises:
        LayoutError: the global batch cannot be split over ``world`` ranks (names the nearest valid choices).
    """
    train = cfg.train
    if not train.global_batch_size:
        problems = fixed_batch_problems(cfg, run_dir)
        if problems:
            raise LayoutError("\n".join(problems))
        return cfg
    plan = plan_batch(train.global_batch_size, world, train.batch_size, run_facts(run_dir).fixed_batch)
    steps = train.num_weight_updates * plan.accumulation
    resolved = train.model_copy(
        update={"batch_size": plan.batch_size, "gradient_accumulation_steps": plan.accumulation,
                "num_train_steps": steps, "eval_batch_size": eval_batch(cfg, run_dir)}  # fmt: skip
    )
    return cfg.model_copy(update={"train": resolved})
