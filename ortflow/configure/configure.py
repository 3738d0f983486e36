"""The configure stage: check the config, build the training artifacts once, and record what was built.

``configure(cfg)`` writes into the run folder (``cfg.output_dir``):

* ``artifacts/`` - the engine's training and eval models and the initial checkpoint;
* ``config.yaml`` - the resolved config every rank loads;
* ``configure.json`` - written last: the fingerprint of what the artifacts were built from, and the inputs the data
  stage must provide (``train_inputs``, in the engine's order, label included), and ``graph_rewrites``: what the
  model-preparation pass (:mod:`ortflow.graph.prepare`) changed in the graph the engine got.

A second call with the same model bytes and the same ``model`` section finds the fingerprint in
``configure.json`` and the artifact files in place, and does no work; in a moved or copied run folder it also
records the artifacts' new place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ortflow.artifacts_folder import (
    ARTIFACT_FILES,
    DIGESTS_KEY,
    ArtifactsDamaged,
    artifact_digests,
    read_pipe_tensor_record,
    read_stages_record,
    read_tensor_record,
    verify_artifacts,
)
from ortflow.config import (
    RESOLVED_CONFIG_NAME,
    ConfigError,
    RunConfig,
    check_files,
    dump_config,
    fixed_batch_problems,
    param_group_problems,
    write_resolved_config,
)
from ortflow.config.sealed import RunFileDamaged, read_configure, record_config, seal, verify_config, write_sealed
from ortflow.configure.artifacts import PROTO_LIMIT, ArtifactsError, build_artifacts, inspect_model
from ortflow.configure.engine_input import repeatable_gathers
from ortflow.configure.pipeline_tensor_parallel_artifacts import (
    build_pipeline_tensor_parallel_artifacts,
    plan_pipeline_tensor_parallel,
)
from ortflow.configure.stage_artifacts import build_stage_artifacts, cut_lines, plan_stages
from ortflow.configure.tensor_parallel_artifacts import build_tensor_parallel_artifacts, plan_tensor_parallel
from ortflow.configure.torch_model import TORCH_MODEL_DIR, torch_source
from ortflow.configure.training_graph import capture_applies, sums_as_matmul_applies
from ortflow.engine import ORT_VERSION
from ortflow.graph.exports.batchnorm_stats import running_statistics, to_record
from ortflow.graph.tensor_parallel.tensor_plan import describe

log = logging.getLogger(__name__)

#: Name of the record configure writes last into the run folder.
CONFIGURE_RECORD_NAME = "configure.json"

# Bump when the artifacts ortflow builds change for the same inputs, so old run folders get rebuilt.
# 2: the batch-dimension pass and the model-preparation pass (ortflow.graph) rewrite the graph before the engine.
# 3: pipeline stages hold BatchNorm running statistics as state, and a middle stage's eval model carries the batch form.
# 4: dynamo exports are built from their torch-named model (ortflow/configure/torch_model.py).
# 5: training models mask torch's padding rows, and the stage and piece records name them (ortflow/configure/
#    training_graph.py).
# 6: stages' and pieces' training models get the leading-axis sums as MatMuls too, and their records say so
#    (``sums_as_matmul``) with each part's rewrites (``rewrites``).
_ARTIFACTS_FORMAT = 6


@dataclass(frozen=True)
class ConfigureResult:
    """What :func:`configure` did.

    Attributes:
        run_dir: The run folder (``cfg.output_dir``).
        artifacts_dir: Folder holding the training artifacts.
        reused: True when the artifacts were already up to date and nothing was built.
        info: The contents of ``configure.json``.
    """

    run_dir: Path
    artifacts_dir: Path
    reused: bool
    info: dict[str, Any]


def _external_data_files(model_path: Path) -> list[Path]:
    proto = onnx.load(str(model_path), load_external_data=False)
    locations = {
        entry.value
        for tensor in proto.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return [model_path.parent / loc for loc in sorted(locations)]


def fingerprint(cfg: RunConfig) -> str:
    """sha256 over the model file, its external data files, the model section and the engine version.

    Args:
        cfg: The run config.

    Returns:
        A hex digest that changes whenever the artifacts would.
    """
    digest = hashlib.sha256()
    for path in [cfg.model.path, *_external_data_files(cfg.model.path)]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    digest.update(cfg.section_fingerprint("model").encode())  # the optimizer is not in the artifacts
    digest.update(f"ort={ORT_VERSION};format={_ARTIFACTS_FORMAT}".encode())
    if cfg.distributed.pipeline_parallel_size > 1:  # stage artifacts depend on the stage count
        digest.update(f";pipeline={cfg.distributed.pipeline_parallel_size}".encode())
    if cfg.precision.use_mixed_precision:  # the autocast pass and the loss-scale input are in the artifacts
        digest.update(f";precision={cfg.section_fingerprint('precision')}".encode())
    # embedding reads rewritten for a repeatable CPU gradient (ortflow/graph/gradients/embedding.py)
    if repeatable_gathers(cfg):
        digest.update(b";gathers=repeatable")
    if sums_as_matmul_applies(cfg):  # the training graph's leading-axis sums as MatMuls (configure/training_graph.py)
        digest.update(b";sums=matmul")
    if capture_applies(cfg):  # the training graph cut for CUDA graphs (configure/training_graph.py)
        digest.update(b";capture")
    if cfg.distributed.horizontal_parallel_size > 1:  # and tensor-parallel pieces on the size and how they are cut
        digest.update(f";tensor={cfg.distributed.horizontal_parallel_size};pieces=folded".encode())
    return digest.hexdigest()


def read_configure_record(run_dir: Path | str) -> dict[str, Any] | None:
    """The ``configure.json`` of a run folder, or None when it is missing, unreadable or differs from its seal."""
    try:
        return read_configure(Path(run_dir))
    except RunFileDamaged as err:
        if (Path(run_dir) / CONFIGURE_RECORD_NAME).exists():
            log.warning("configure: %s", err)
        return None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    write_sealed(path, data)  # sealed: every reader checks its record_sha256
    return seal(data)


def _write_config_if_changed(cfg: RunConfig) -> None:
    # Sections outside the fingerprint (batch size, schedule, ...) may change without a rebuild; the ranks must
    # still see them, so the resolved config is rewritten whenever its text differs (or its record does).
    target = cfg.output_dir / RESOLVED_CONFIG_NAME
    try:
        unchanged = target.read_text() == dump_config(cfg)
        verify_config(cfg.output_dir)
    except (OSError, RunFileDamaged):
        unchanged = False
    if not unchanged:
        write_resolved_config(cfg)


def _split_artifacts_exist(cfg: RunConfig, artifacts_dir: Path) -> bool:
    """The pipeline stages', tensor-parallel pieces' or pp x tp pieces' artifacts that this config needs are built."""
    pp, tp = cfg.distributed.pipeline_parallel_size, cfg.distributed.horizontal_parallel_size
    if pp > 1 and tp > 1:
        return read_pipe_tensor_record(artifacts_dir) is not None
    return ((pp == 1 or read_stages_record(artifacts_dir) is not None)
            and (tp == 1 or read_tensor_record(artifacts_dir) is not None))


def _artifacts_intact(artifacts_dir: Path, record: dict) -> bool:
    """Whether the artifacts match the checksums configure.json recorded (a damaged file is rebuilt, not reused)."""
    try:
        verify_artifacts(artifacts_dir, record)
    except ArtifactsDamaged as err:
        log.warning("configure: rebuilding the artifacts: %s", err)
        return False
    return True


def plan_layout(cfg: RunConfig, described: list[str] | None = None, proto_limit: int = PROTO_LIMIT):
    """Refuse a bad pipeline or tensor-parallel split before anything is built (fast: onnx only, no engine).

    Args:
        cfg: The run.
        described: When given, the split plan in words is appended to it (the cuts; per tensor-parallel region what
            is split how, and each weight kept replicated with the reason), as ``ortflow validate`` prints it.
        proto_limit: Model bytes from which the stages and tensor-parallel pieces are cut with their weights left in
            the data files (2 GiB; tests lower it).

    Returns:
        The plan the layout's builder takes, so it is made once: the pipeline plan (cuts, stages) for pipeline stages
        alone, the tensor-parallel plan for tensor pieces alone, the cuts and each stage's split for both, else None.

    Raises:
        ArtifactsError: The split is refused, naming what and the fix.
    """
    pp, tp = cfg.distributed.pipeline_parallel_size, cfg.distributed.horizontal_parallel_size
    lines, plan, batchnorm_stages = [], None, []
    if pp > 1 and tp > 1:
        # each stage's graph split over the tp ranks
        plan = plan_pipeline_tensor_parallel(cfg, proto_limit)
        lines = cut_lines(plan.cuts, [sp.stage for sp in plan.plans], plan.places)
        lines += [f"stage {sp.stage.index}: {line}" for sp in plan.plans for line in describe(sp.plan)]
    elif tp > 1:
        plan = plan_tensor_parallel(cfg, proto_limit)
        lines = describe(plan[1])
    elif pp > 1:
        plan = plan_stages(cfg, proto_limit)
        lines += plan.lines()
        # their eval model's forward normalises by the batch only as a twin the training call recomputes
        batchnorm_stages = [s.index for s in plan.stages[:-1] if any(n.op_type == "BatchNormalization"
                                                                  for n in s.model.graph.node)]
    if pp > 1:
        refuse_tied_zero1(cfg, plan.stages if tp == 1 else [sp.stage for sp in plan.plans])
    activations = cfg.distributed.activations_line(batchnorm_stages)
    if lines and activations:
        lines.append(activations)
    if described is not None:
        described.extend(lines)
    return plan


def refuse_tied_zero1(cfg: RunConfig, stages: list) -> None:
    """ZeRO-1 over the replicas of pipeline stages that hold one tied weight (an embedding tied to the LM head, read in
    the first and the last stage): each stage's replicas shard its gradients before the holders could add theirs, so
    the ranks refuse it; refused here first, by configure and ``ortflow validate``, before anything is built.

    Raises:
        ArtifactsError: The layout is refused, naming the weights and the fix.
    """
    dist = cfg.distributed
    layout = dist.pipeline_parallel_size * dist.horizontal_parallel_size
    replicas = dist.data_parallel_size or (None if dist.num_ranks == "auto" else dist.num_ranks // layout)
    shared = {name: holders for stage in stages for name, holders in stage.shared.items()}
    if dist.zero_stage == 1 and shared and (replicas is None or replicas > 1):
        tied = ", ".join(f"'{name}' (stages {', '.join(map(str, holders))})"
                         for name, holders in sorted(shared.items()))
        raise ArtifactsError(
            f"distributed.zero_stage 1 with pipeline stages that share a tied weight: {tied}; ZeRO-1 shards each "
            "stage's gradients over its replicas before the stages holding the weight add theirs. Use "
            "distributed.zero_stage 0 (or enable_adasum) with this model in pipeline stages, or "
            "pipeline_parallel_size 1")


def op_types(model_path: Path) -> list[str]:
    """The op types of the model's graph, sorted (its subgraphs' too)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    found, todo = set(), [graph]
    while todo:
        g = todo.pop()
        for node in g.node:
            found.add(node.op_type)
            todo += [a.g for a in node.attribute if a.HasField("g")] + [x for a in node.attribute for x in a.graphs]
    return sorted(found)


def build_layout(cfg: RunConfig, artifacts_dir: Path, stale_record: Path | None = None,
                 proto_limit: int = PROTO_LIMIT):
    """Build the whole model's artifacts and the stages and pieces of the configured layout into ``artifacts_dir``.

    Used by configure and by ``validate --deep`` (in a temporary folder), so both build the same graphs.
    ``proto_limit``: model bytes from which the weights stay in their files while the engine builds (2 GiB).

    A dynamo export is built from its torch-named model (:func:`ortflow.configure.torch_model.torch_source`), written
    beside ``artifacts_dir``; ``built.torch`` records its parameters.

    Returns:
        (what build_artifacts built, the stages record or None, the tensor-parallel record or None).

    Raises:
        ArtifactsError: The config does not fit the model, the split is refused, or the engine cannot build a graph.
    """
    pp, tp = cfg.distributed.pipeline_parallel_size, cfg.distributed.horizontal_parallel_size
    cfg, found = torch_source(cfg, Path(artifacts_dir).parent / TORCH_MODEL_DIR)
    plan = plan_layout(cfg, proto_limit=proto_limit)  # refuse a bad split before building anything
    built = build_artifacts(cfg, artifacts_dir, stale_record=stale_record, proto_limit=proto_limit)
    built = dataclasses.replace(built, torch=found.to_record() if found else None)
    if pp > 1 and tp > 1:
        stages = build_pipeline_tensor_parallel_artifacts(cfg, artifacts_dir, plan, proto_limit)
        split = [f"stage {s['index']}: {line}" for s in stages["stages"] for line in s["split"]]
        return built, stages, {"split": split}
    if tp > 1:
        return built, None, build_tensor_parallel_artifacts(cfg, artifacts_dir, plan, proto_limit)
    return built, (build_stage_artifacts(cfg, artifacts_dir, plan, proto_limit) if plan else None), None


def graph_passes(model: tuple[str, ...], stages: dict | None, tensor: dict | None) -> dict[str, list[str]]:
    """The preparation passes each graph the engine got went through, by graph: the whole model, each pipeline
    stage, each tensor-parallel rank's pieces and each stage's pieces of each rank (pipeline x tensor)."""
    found = {"model": list(model)}
    for stage in (stages or {}).get("stages", []):
        if isinstance(stage.get("passes"), dict):
            found.update({f"stage-{stage['index']:02d}/{key}": ran for key, ran in stage["passes"].items()})
        else:
            found[f"stage-{stage['index']:02d}"] = stage.get("passes", [])
    found.update((tensor or {}).get("passes", {}))
    return found


def split_graph_rewrites(stages: dict | None, tensor: dict | None) -> dict[str, list[dict]]:
    """What the passes over each pipeline stage's and tensor-parallel piece's training model changed (``graph_rewrites``
    of the whole model's, :func:`ortflow.configure.training_graph.rewrite_part_training_model`), by graph as in
    :func:`graph_passes`; graphs no pass changed are left out."""
    found: dict[str, list[dict]] = {}
    for stage in (stages or {}).get("stages", []):
        rewrites = stage.get("rewrites", [])
        if isinstance(rewrites, dict):
            found.update({f"stage-{stage['index']:02d}/{key}": changed for key, changed in rewrites.items()})
        else:
            found[f"stage-{stage['index']:02d}"] = rewrites
    found.update((tensor or {}).get("rewrites", {}))
    return {key: changed for key, changed in found.items() if changed}
def _refuse_bad_groups(cfg: RunConfig, trainable: list[str]) -> None:
    """optimizer.groups against the trained parameters (the artifacts do not depend on it, so also when reused)."""
    problems = param_group_problems(trainable, cfg.optimizer)
    if problems:
        raise ConfigError(problems)


def configure(cfg: RunConfig, proto_limit: int = PROTO_LIMIT) -> ConfigureResult:
    """Check the config and its files, build the training artifacts if needed, and record them in the run folder.

    Args:
        cfg: The run config.
        proto_limit: Model bytes from which the weights stay in their files while the engine builds (2 GiB; tests
            lower it to take that path on small models).

    Returns:
        Where the run folder and artifacts are, whether existing artifacts were reused, and the configure record.

    Raises:
        ConfigError: With every problem found, each naming the field to fix (missing or unrunnable model, frozen
            patterns that match nothing, a loss output the model lacks, ...).
    """
    problems = check_files(cfg)
    if problems:
        raise ConfigError(problems)
    _refuse_unresumable_checkpoint(cfg)
    run_dir, artifacts_dir = cfg.output_dir, cfg.artifacts_dir
    record_path = run_dir / CONFIGURE_RECORD_NAME
    key = fingerprint(cfg)

    previous = read_configure_record(run_dir)
    if (
        previous is not None
        and previous.get("fingerprint") == key
        and all((artifacts_dir / name).exists() for name in ARTIFACT_FILES)
        and _split_artifacts_exist(cfg, artifacts_dir)
        and _artifacts_intact(artifacts_dir, previous)
    ):
        _refuse_bad_groups(cfg, previous.get("trainable", []))
        if previous.get("artifacts_dir") != str(artifacts_dir):  # a moved or copied folder: its artifacts verified here
            previous = _write_json_atomic(record_path, {**previous, "artifacts_dir": str(artifacts_dir)})
        _write_config_if_changed(cfg)
        log.info("configure: unchanged, reusing %s", artifacts_dir)
        return ConfigureResult(run_dir, artifacts_dir, reused=True, info=previous)

    run_dir.mkdir(parents=True, exist_ok=True)
    model = inspect_model(cfg.model.path)
    try:
        # The old record is deleted just before the artifacts are replaced: it must never vouch for new artifacts.
        built, stages, tensor_record = build_layout(cfg, artifacts_dir, stale_record=record_path,
                                                    proto_limit=proto_limit)
    except ArtifactsError as err:
        raise ConfigError([str(err)]) from None
    _refuse_bad_groups(cfg, list(built.trainable))
    write_resolved_config(cfg)
    record = {
        "fingerprint": key,
        "model_path": str(cfg.model.path),
        "artifacts_dir": str(artifacts_dir),
        "artifact_files": list(ARTIFACT_FILES),
        "train_inputs": [t.to_dict() for t in built.train_inputs],
        "eval_inputs": [t.to_dict() for t in built.eval_inputs],
        "model_inputs": [t.to_dict() for t in model.inputs],
        "model_outputs": [t.to_dict() for t in model.outputs],
        "trainable": list(built.trainable),
        "torch": built.torch,  # dynamo exports: what is trained under which torch name, untied, frozen and why
        "frozen": list(built.frozen),
        "loss": built.loss,
        "loss_output": built.loss_output,
        "label_input": built.label_input,
        "num_parameters": built.num_parameters,
        "graph_rewrites": list(built.rewrites),
        "batch": built.batch.to_dict() if built.batch else None,
        "optimizer": cfg.optimizer.name,
        "opset": model.opset,
        "ir_version": model.ir_version,
        "ort_version": ORT_VERSION,
        DIGESTS_KEY: artifact_digests(artifacts_dir),  # rank 0 checks them before training
        "pipeline_cuts": stages["cuts"] if stages else [],
        "tensor_parallel_split": tensor_record["split"] if tensor_record else [],
        "graph_passes": graph_passes(built.passes, stages, tensor_record),
        "split_graph_rewrites": split_graph_rewrites(stages, tensor_record),
        "batchnorm": to_record(running_statistics(cfg.model.path)),  # read by the ranks (trainer/batchnorm.py)
        "op_types": op_types(cfg.model.path),  # the GPU ranks check the libraries they need (trainer/startup.py)
        # input -> [table, rows] of the embeddings it indexes: prepare-data refuses a tokenizer with more ids
        "token_tables": model.token_tables,
    }
    record = _write_json_atomic(record_path, record)
    log.info("configure: built artifacts in %s (%d trainable parameters)", artifacts_dir, built.num_parameters)
    return ConfigureResult(run_dir, artifacts_dir, reused=False, info=record)


def _refuse_unresumable_checkpoint(cfg: RunConfig) -> None:
    """A layout or optimizer that the checkpoint the ranks would resume cannot feed (written with another pipeline or
    tensor-parallel split, or its optimizer state by another optimizer) is refused here, before the config is recorded
    in the run folder or an artifact is built: the ranks would refuse it at start, and a later command would otherwise
    read the refused config from the folder, or find the artifacts of the checkpoint's layout rebuilt for another."""
    from ortflow.checkpoints.layout_check import resume_layout_refusal

    refusal = resume_layout_refusal(cfg)
    if refusal:
        raise ConfigError([f"checkpoint: {refusal}"])


def accept_config_edit(cfg: RunConfig) -> None:
    """Record a hand-edited ``config.yaml`` as the run's config (``ortflow train --accept-changed-config``), when the
    edit leaves the artifacts valid (the same configure fingerprint: model, precision, layout unchanged).

    Raises:
        ConfigError: the edit changes what the artifacts were built from, or the folder is not configured.
    """
    try:
        record = read_configure(cfg.output_dir)
    except RunFileDamaged as err:
        raise ConfigError([str(err)]) from None
    if record.get("fingerprint") != fingerprint(cfg):
        raise ConfigError([f"{cfg.output_dir / RESOLVED_CONFIG_NAME}: the edit changes what the artifacts were built "
                           "from (the model, precision or parallel layout), so it cannot be accepted as it is: put "
                           "it in your config and run `ortflow configure CONFIG` again"])
    problems = fixed_batch_problems(cfg, cfg.output_dir)  # prepare-data checks a new config's; an edit skips it
    if problems:
        raise ConfigError([f"{cfg.output_dir / RESOLVED_CONFIG_NAME}: {p}" for p in problems])
    _refuse_unresumable_checkpoint(cfg)
    record_config(cfg.output_dir)
    log.info("configure: accepted the edited %s", cfg.output_dir / RESOLVED_CONFIG_NAME)

