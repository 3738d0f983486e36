"""The pipeline's tasks other than train: each calls one plain function and returns a small JSON-ready record."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from ortflow.checkpoints.retention import reason_label
from ortflow.config import RunConfig
from ortflow.launch.job import read_record
from ortflow.tasks.caching import StageCache
from ortflow.tasks.policy import artifact_key, forward_logs, retry_transient
from ortflow.trainer.metrics import read_progress
from ortflow.versions import EXPORTED_LOCAL_COPY

# Every stage writes its outputs atomically and skips work that is already done, so running one twice is safe.
_RETRY = {"retries": 2, "retry_delay_seconds": [2, 10], "retry_condition_fn": retry_transient}


@task(name="check_launcher")
def check_launcher(config: RunConfig) -> None:
    """Refuse a scheduler request that could never start (``sbatch --test-only``, partition, slots) before configure
    and data preparation spend their time (a ConfigError: not retried)."""
    from ortflow.config import ConfigError
    from ortflow.launch.slurm_check import request_problems

    problems = request_problems(config)
    if problems:
        raise ConfigError(problems, "the slurm section")


@task(name="configure", cache_policy=StageCache(stage="configure"), persist_result=True, **_RETRY)
def configure(config: RunConfig) -> dict:
    """Build the training artifacts (or find them up to date) and write the resolved config into the run folder."""
    from ortflow.configure.configure import configure as run_configure

    with forward_logs():
        result = run_configure(config)
    return {
        "run_dir": str(result.run_dir),
        "artifacts_dir": str(result.artifacts_dir),
        "reused": result.reused,
        "fingerprint": result.info.get("fingerprint"),
    }


@task(name="prepare_data", cache_policy=StageCache(stage="prepare_data"), persist_result=True, **_RETRY)
def prepare_data(config: RunConfig) -> dict:
    """Shard the sources into Arrow files and write the manifest (a no-op when they are up to date)."""
    from ortflow.dataprep import prepare_data as run_prepare

    with forward_logs():
        manifest = run_prepare(config)
    return {
        "data_dir": str(config.data_dir),
        "reused": manifest.reused,
        "fingerprint": manifest.fingerprint,
        "rows": {split: manifest.num_rows(split) for split in manifest.splits},
    }


@task(name="retain_checkpoints", cache_policy=StageCache(stage="retain"), persist_result=True, **_RETRY)
def retain_checkpoints(config: RunConfig) -> dict:
    """Keep the newest, best and final checkpoints, delete the rest, and write ``checkpoints.json``."""
    from ortflow.checkpoints.retention import retain_checkpoints as run_retain

    with forward_logs():
        index = run_retain(config)
    return index.to_dict()


@task(name="export", cache_policy=StageCache(stage="export"), persist_result=True, **_RETRY)
def export(config: RunConfig) -> dict:
    """Export the inference model from the run's best (else newest) checkpoint to ``export.path``, verified."""
    from ortflow.export import export_model

    opts = config.export
    with forward_logs():
        result = export_model(
            config.output_dir, config.export_path, outputs=opts.outputs, optimize=opts.optimize,
            quantize=opts.quantize, tolerance=opts.tolerance, config=config,
        )
    return result.to_dict()


@task(name="export_checkpoint", cache_policy=NO_CACHE, **_RETRY)
def export_checkpoint(
    checkpoint: str, output: str, outputs: tuple[str, ...] = (), optimize: bool = False, quantize: bool = False,
    tolerance: float = 1e-4,
) -> dict:
    """Export one checkpoint folder (or a run folder's best checkpoint) to ``output``; see ``export_model``."""
    from ortflow.export import export_model
    from ortflow.versions import resolve_run

    with forward_logs():
        result = export_model(
            resolve_run(Path(checkpoint)), Path(output), outputs=outputs, optimize=optimize, quantize=quantize,
            tolerance=tolerance,
        )
    create_markdown_artifact(
        key="ortflow-export",
        markdown=f"Exported step {result.step} of `{result.checkpoint}` to `{result.path}`; max abs difference to "
        f"the eval graph {result.verification.max_abs_diff} (tolerance {result.verification.tolerance}).",
        description="ortflow export",
    )
    return result.to_dict()


def summary_rows(
    progress: dict | None, index: dict | None, exported: dict | None, version: str | None = None,
    exported_url: str | None = None,
) -> list[dict]:
    """The pipeline's result as metric/value rows: steps, final and best eval loss, throughput, checkpoints, model
    (its URL and then its local copy when ``exported_url``, the model on object storage, is given)."""
    progress, index, exported = progress or {}, index or {}, exported or {}
    kept, newest = index.get("kept", []), index.get("keep_newest")

    def why(entry: dict) -> str:
        return ", ".join(reason_label(r, newest) for r in entry.get("reasons", []))

    scored = [k["eval_loss"] for k in kept if k.get("eval_loss") is not None]
    rows = [("version", version)] if version else []
    rows += [
        ("steps", f"{progress.get('step')}/{progress.get('total')}"),
        ("final train loss", progress.get("loss")),
        ("final eval loss", progress.get("eval_loss")),
        ("best eval loss", min(scored) if scored else None),
        ("samples/s", progress.get("samples_per_s")),
        *([("tokens/s", progress["tokens_per_s"])] if progress.get("tokens_per_s") is not None else []),  # text only
        ("kept checkpoints", ", ".join(f"step {k['step']} ({why(k)})" for k in kept) or None),
        ("exported model", exported_url or exported.get("path")),
        *([(EXPORTED_LOCAL_COPY, exported.get("path"))] if exported_url else []),
        ("export source step", exported.get("step")),
        ("exported model sha256", exported.get("sha256")),
    ]
    return [{"metric": name, "value": value} for name, value in rows]


def _markdown(name: str, rows: list[dict]) -> str:
    def fmt(value: object) -> str:
        if value is None:
            return "-"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = [f"# ortflow run `{name}`", "", "| metric | value |", "|---|---|"]
    lines += [f"| {r['metric']} | {fmt(r['value'])} |" for r in rows]
    return "\n".join(lines)


@task(name="publish_summary", cache_policy=NO_CACHE)
def publish_summary(config: RunConfig, index: dict, exported: dict, version: str | None = None) -> dict:
    """Publish the run's result as a markdown and a table artifact (always runs, so every flow run shows one), with
    keys stable per run name: ``ortflow-<name>-summary`` and ``ortflow-<name>-results``."""
    from ortflow.checkpoints.run_store import store_url

    url = store_url(config, exported["path"]) if (exported or {}).get("path") else None
    rows = summary_rows(read_progress(config.output_dir), index, exported, version, url)
    job = read_record(config.output_dir)  # the launcher and job that trained the run folder last
    if job and job.get("job_id"):
        rows.append({"metric": f"{job['launcher']} job", "value": job["job_id"]})
    create_markdown_artifact(_markdown(config.name, rows), key=artifact_key(config, "summary"),
                             description=f"Result of {config.name}")
    create_table_artifact(rows, key=artifact_key(config, "results"), description=f"Result of {config.name}")
    return {row["metric"]: row["value"] for row in rows}
