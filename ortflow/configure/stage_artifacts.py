"""Build each pipeline stage's training artifacts once, in configure (docs/engine.md says why this way).

For stage ``s`` of ``P`` the folder ``artifacts/stages/stage-SS/`` holds the engine's training and eval models and
initial state (no optimizer graph: ortflow updates the weights):

* a middle stage's loss is ``sum_i ReduceSum(y_i * g_i)`` over what it sends, with the arriving gradients ``g_i``
  (``<y_i>.grad_in``) as inputs: its parameter gradients are then exactly the vector-Jacobian product; the sent
  tensors stay outputs of the eval model (``additional_output_names``), which gives the forward pass, and are removed
  from the training model's outputs (the forward pass has sent them already);
* the last stage keeps the configured loss (the same block as unsplit training);
* every stage but the first lists what it receives in ``requires_grad``; the engine's accumulator for those input
  gradients is removed and each comes out, per call, as ``<name>.backprop`` right after the loss.

``stages.json`` in ``artifacts/stages/`` records the cuts and each stage's tensors; it is written last.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import onnx
from onnx import helper

from ortflow.artifacts_folder import (
    ARTIFACT_FILES,
    BACKPROP_SUFFIX,
    BATCH_STATISTICS_INPUT,
    GRAD_IN_SUFFIX,
    STAGES_DIR,
    STAGES_RECORD,
)
from ortflow.config import RunConfig
from ortflow.configure.artifacts import (
    PROTO_LIMIT,
    ArtifactsError,
    ConfiguredLoss,
    check_loss_io,
    in_mixed_precision,
    inspect_model,
    loss_block,
    split_parameters,
)
from ortflow.configure.building import building
from ortflow.configure.engine_input import engine_input, prepare_cut, split_source
from ortflow.configure.mixed_precision import scale_input, unscale_eval_model
from ortflow.configure.training_graph import rewrite_part_training_model, sums_as_matmul_applies, torch_padding_rows
from ortflow.engine import artifacts as engine_artifacts
from ortflow.engine import onnxblock
from ortflow.graph.pipeline_parallel.batchnorm_forward import switch_to_batch_statistics
from ortflow.graph.pipeline_parallel.pipeline_cuts import CutEstimate, CutPlace, Stage, split_model
from ortflow.graph.prepare import PreparedModel

log = logging.getLogger(__name__)

class VJPLoss(onnxblock.Block):
    """loss = sum over sent tensors of ReduceSum(y * g), g the gradient that the next stage sends back."""

    def __init__(self, sends: tuple[str, ...], types: dict[str, onnx.ValueInfoProto]):
        super().__init__()
        self._sends, self._types = sends, types

    def build(self, *outputs: str) -> str:
        graph = self.base.graph
        terms = []
        for name in self._sends:
            grad_in = name + GRAD_IN_SUFFIX
            declared = self._types[name]
            graph.input.append(helper.make_value_info(grad_in, declared.type))
            graph.node.append(helper.make_node("Mul", [name, grad_in], [f"{name}.vjp_prod"]))
            graph.node.append(helper.make_node("ReduceSum", [f"{name}.vjp_prod"], [f"{name}.vjp"], keepdims=0))
            terms.append(f"{name}.vjp")
        total = terms[0]
        for k, term in enumerate(terms[1:], 1):  # Add, not Sum: the engine has no gradient builder for Sum
            out = "pipeline.vjp_loss" if k == len(terms) - 1 else f"pipeline.vjp_partial{k}"
            graph.node.append(helper.make_node("Add", [total, term], [out]))
            total = out
        return total


def expose_input_gradients(path: Path, names: tuple[str, ...]) -> None:
    """Replace the engine's accumulators of the received tensors' gradients by per-call outputs ``<name>.backprop``.

    ``api.Module`` returns only outputs whose names lack ``_grad``, hence the rename through Identity.
    """
    model = onnx.load(str(path))
    graph = model.graph
    extra = []
    for name in names:
        grad = f"{name}_grad"
        acc = next((n for n in graph.node if n.op_type == "InPlaceAccumulatorV2" and n.input[1] == grad), None)
        if acc is None:
            raise ArtifactsError(
                f"the engine built no gradient for the stage input '{name}': nothing before it reaches the loss "
                "differentiably; choose another model.pipeline_cuts"
            )
        graph.node.remove(acc)
        for item in [i for i in graph.input if i.name == acc.input[0]]:
            graph.input.remove(item)
        for item in [o for o in graph.output if o.name in acc.output]:
            graph.output.remove(item)
        graph.node.append(helper.make_node("Identity", [grad], [name + BACKPROP_SUFFIX]))
        extra.append(helper.make_empty_tensor_value_info(name + BACKPROP_SUFFIX))
    user = [o for o in graph.output if "_grad" not in o.name]
    grads = [o for o in graph.output if "_grad" in o.name]
    del graph.output[:]
    graph.output.extend([user[0], *extra, *user[1:], *grads])
    onnx.save(model, str(path))


def strip_vjp_from_eval(path: Path, sends: tuple[str, ...]) -> None:
    """A middle stage's eval model computes only what it sends: the VJP loss and its gradient inputs are removed."""
    model = onnx.load(str(path))
    graph = model.graph
    grad_inputs = {n + GRAD_IN_SUFFIX for n in sends}
    # the VJP terms, and the Adds that sum them (``pipeline.vjp_partialK`` with three or more sent tensors)
    keep = [n for n in graph.node if not grad_inputs.intersection(n.input) and not n.output[0].endswith(".vjp")
            and n.output[0] != "pipeline.vjp_loss" and not n.output[0].startswith("pipeline.vjp_partial")]
    del graph.node[:]
    graph.node.extend(keep)
    inputs = [i for i in graph.input if i.name not in grad_inputs]
    del graph.input[:]
    graph.input.extend(inputs)
    outputs = [o for o in graph.output if o.name in sends]
    del graph.output[:]
    graph.output.extend(outputs)
    onnx.save(model, str(path))


def forward_with_batch_statistics(path: Path) -> None:
    """A middle stage's eval model also computes its training forward pass: BatchNorm by the batch's statistics when
    its ``BATCH_STATISTICS_INPUT`` is true (:mod:`ortflow.graph.pipeline_parallel.batchnorm_forward`)."""
    model = onnx.load(str(path))
    if switch_to_batch_statistics(model, BATCH_STATISTICS_INPUT):
        onnx.save(model, str(path))


def drop_sends_from_training(path: Path, sends: tuple[str, ...]) -> None:
    """A middle stage's training model outputs the VJP loss, not the sent tensors: the forward pass has already sent
    them, and as outputs the engine would copy each out and keep it through the backward pass (stage 0 of the bench
    GPT at 32 sequences: 1 MiB of its 68 MiB working set)."""
    model = onnx.load(str(path))
    graph = model.graph
    outputs = [o for o in graph.output if o.name not in sends]
    del graph.output[:]
    graph.output.extend(outputs)
    onnx.save(model, str(path))


def prepare_part(cfg: RunConfig, stage: Stage, last: bool):
    """A pipeline stage's or tensor-parallel piece's graph prepared as the whole model is (graph/prepare.py), then
    autocast alone in mixed precision (what crosses to another part stays fp32); and the loss-scale input its loss
    takes (fp16, the part holding the loss; the others pass the scaled gradients back)."""
    output_name = check_loss_io(cfg, inspect_model(cfg.model.path)) if last else None
    prepared = in_mixed_precision(cfg, prepare_cut(cfg, stage.model, stage.parameters, output_name))
    return prepared, scale_input(cfg) if last else None


def finish_part(folder: Path, scale: str | None, sends: tuple[str, ...] | None, receives: tuple[str, ...]) -> None:
    """What the engine built for a stage or piece, fitted to its calls: the eval model's scale input fixed to 1, a
    middle part's gradient inputs dropped from its eval model (``sends``: None for the part holding the loss), the
    gradients of what it received exposed; refuses a folder the engine left incomplete."""
    (folder / "temp.onnx").unlink(missing_ok=True)
    if scale:
        unscale_eval_model(folder / "eval_model.onnx", scale)
    if sends is not None:
        strip_vjp_from_eval(folder / "eval_model.onnx", sends)
    if receives:
        expose_input_gradients(folder / "training_model.onnx", receives)
    missing = [f for f in ARTIFACT_FILES if not (folder / f).exists()]
    if missing:
        raise RuntimeError(f"the engine did not write {missing} into {folder}")


def generate_part(cfg: RunConfig, prepared, folder: Path, proto_limit: int, scale: str | None,
                  sends: tuple[str, ...] | None, vjp_sends: tuple[str, ...], requires_grad: list[str],
                  frozen_params: list[str]) -> None:
    """The engine's artifacts of a pipeline stage or tensor-parallel piece into ``folder``: its loss is the configured
    one for the part holding the loss (``sends`` None), else the vector-Jacobian product of ``vjp_sends`` (the float
    ones of ``sends``, which stay outputs of the eval model).

    The engine gets the part through :func:`ortflow.configure.engine_input.engine_input`: past ``proto_limit`` its
    initializers point into data files linked (the user's) or written (a piece's slices) into ``folder``, the engine
    runs with ``folder`` as the current folder and reads each weight into the checkpoint, and the files are removed
    after: the checkpoint holds the weights."""
    engine_model, linked = engine_input(Path(cfg.model.path), prepared, folder, proto_limit)
    try:
        # the engine's checkpoint writer reads external data relative to the current folder, and a loss block notes
        # the current folder when made (for temp.onnx): both in the engine's folder
        with contextlib.chdir(folder) if linked else contextlib.nullcontext():
            if sends is None:
                loss: onnxblock.Block = ConfiguredLoss(loss_block(cfg), prepared.loss_input, prepared.label_input,
                                                       scale)
                extra = None
            else:
                loss, extra = VJPLoss(vjp_sends, {o.name: o for o in prepared.model.graph.output}), list(sends)
            engine_artifacts.generate_artifacts(
                engine_model,
                requires_grad=requires_grad,
                frozen_params=frozen_params,
                loss=loss,
                optimizer=None,  # ortflow updates the weights (ortflow.trainer.optim): no optimizer graph
                artifact_directory=folder,
                additional_output_names=extra,
            )
    finally:
        for name in linked:
            (folder / name).unlink(missing_ok=True)


def _build_one(cfg: RunConfig, stage: Stage, last: bool, frozen: set[str], folder: Path,
               proto_limit: int = PROTO_LIMIT,
               padding: dict[str, int] | None = None) -> tuple[tuple[str, ...], dict[str, int], list[dict]]:
    """Build one stage's artifacts into ``folder``; returns the preparation passes its graph went through (a stage of
    a model past ``proto_limit`` reaches the engine as the whole model does: :func:`generate_part`), the padding
    rows of its tables where its training model masks a lookup gradient (``padding``: table -> torch's padding row;
    empty where it masks none) and the report entries of the passes over its training model
    (:func:`ortflow.configure.training_graph.rewrite_part_training_model`)."""
    folder.mkdir(parents=True)
    prepared, scale = prepare_part(cfg, stage, last)
    held = frozen | set(stage.frozen) | set(prepared.frozen)
    sends = None if last else stage.sends
    generate_part(cfg, prepared, folder, proto_limit, scale, sends, stage.sends,
                  requires_grad=[*(p for p in stage.parameters if p not in prepared.frozen), *stage.receives],
                  frozen_params=sorted(t.name for t in prepared.model.graph.initializer if t.name in held))
    finish_part(folder, scale, sends, stage.receives)
    rows = {t: r for t, r in (padding or {}).items() if t in stage.parameters}
    masked, rewrites = rewrite_part_training_model(cfg, folder / "training_model.onnx", rows,
                                                   f"pipeline stage {stage.index}")
    if not last:
        drop_sends_from_training(folder / "training_model.onnx", stage.sends)
        forward_with_batch_statistics(folder / "eval_model.onnx")
    return prepared.passes, masked, rewrites


class PipelinePlan(NamedTuple):
    """The cuts, the stages (each with its estimated share of the compute), and every place the automatic cuts may
    cut, for the plan's words."""

    cuts: list[str]
    stages: list[Stage]
    places: list[CutPlace]

    def lines(self) -> list[str]:
        """The plan in words, as ``ortflow validate`` prints it."""
        return cut_lines(self.cuts, self.stages, self.places)


def cut_lines(cuts: list[str], stages: list[Stage], places: list[CutPlace]) -> list[str]:
    """The cuts with each stage's estimated share of the compute, and the other places to cut with theirs."""
    shares = " / ".join(f"{s.share:.1%}" for s in stages)
    lines = [f"pipeline cuts {cuts} ({len(stages)} stages; estimated compute per stage {shares}, from the parameters "
             "each reads)"]
    others = [p for p in places if p.name not in cuts]
    if others:
        lines.append("other places to cut (model.pipeline_cuts), with the estimated compute before each: "
                     + ", ".join(f"{p.name} ({p.share:.1%})" for p in others[:12])
                     + (f" and {len(others) - 12} more" if len(others) > 12 else ""))
    return lines


def plan_stages(cfg: RunConfig, proto_limit: int = PROTO_LIMIT, source: PreparedModel | None = None) -> PipelinePlan:
    """The cuts (``model.pipeline_cuts`` or balanced), the stages with their estimated shares of the compute and the
    places to cut (:class:`PipelinePlan`), or the refusal: fast, no engine call.

    ``proto_limit``: model bytes from which the stages are cut with their weights left in the data files
    (:func:`ortflow.configure.engine_input.split_source`); 2 GiB, lowered by tests. ``source``: what
    :func:`~ortflow.configure.engine_input.split_source` returned for ``cfg``, where the caller has it (left unchanged).

    Raises:
        ArtifactsError: The split is refused (names the tensors/nodes and the fix).
    """
    from ortflow.graph.pipeline_parallel.pipeline_cuts import SplitError

    num = cfg.distributed.pipeline_parallel_size
    trainable, _ = split_parameters(inspect_model(cfg.model.path), cfg.model.frozen)
    # The whole model through the batch pass and the preparation passes first: stages compute what it computes,
    # inherit its symbolic batch, and read their shape arithmetic from the inputs (graph/shapes.py).
    source = source or split_source(cfg, trainable, proto_limit)
    model = source.model
    trainable = [n for n in trainable if n not in source.frozen]
    estimate = CutEstimate(model, trainable)
    try:
        cuts = list(cfg.model.pipeline_cuts) or estimate.choose(num)
        stages = split_model(model, cuts, trainable)
    except SplitError as err:
        raise ArtifactsError(f"distributed.pipeline_parallel_size {num}: {err}") from None
    # The state the whole model's preparation froze (running statistics) stays state in the stage that reads it.
    shares = estimate.shares(cuts)
    stages = [replace(s, frozen=tuple(t.name for t in s.model.graph.initializer if t.name in source.frozen),
                      share=shares[s.index]) for s in stages]
    empty = [s.index for s in stages if not s.parameters]
    if empty:
        raise ArtifactsError(f"pipeline stages {empty} hold no trainable parameter; move model.pipeline_cuts {cuts}")
    return PipelinePlan(cuts, stages, estimate.places())


def build_stage_artifacts(cfg: RunConfig, artifacts_dir: Path, plan: PipelinePlan | None = None,
                          proto_limit: int = PROTO_LIMIT) -> dict:
    """Build every stage's artifacts under ``artifacts_dir`` (from :func:`plan_stages`, made here if not given).

    ``proto_limit``: model bytes from which each stage reaches the engine with its weights in the data files (2 GiB).

    Returns:
        The ``stages.json`` record.

    Raises:
        ArtifactsError: The split is refused (names the tensors/nodes) or the engine cannot build a stage.
    """
    num = cfg.distributed.pipeline_parallel_size
    cuts, stages, _ = plan or plan_stages(cfg, proto_limit)
    _, frozen = split_parameters(inspect_model(cfg.model.path), cfg.model.frozen)
    padding = torch_padding_rows(cfg)
    with building(artifacts_dir, STAGES_DIR) as scratch:
        passes, masked, rewrites = [], [], []
        for stage in stages:
            try:
                ran, masks, changed = _build_one(cfg, stage, stage.index == num - 1, set(frozen),
                                                 scratch / f"stage-{stage.index:02d}", proto_limit, padding)
                passes.append(list(ran))
                masked.append(masks)
                rewrites.append(changed)
            except ArtifactsError:
                raise
            except Exception as err:  # noqa: BLE001 - the engine raises bare RuntimeErrors and C++ errors
                raise ArtifactsError(
                    f"the engine could not build pipeline stage {stage.index} (cut at {cuts}): "
                    f"{type(err).__name__}: {err}"
                ) from err
        record = {
            "cuts": cuts,
            "stages": [
                {"index": s.index, "receives": list(s.receives), "sends": list(s.sends),
                 "data_inputs": list(s.data_inputs), "parameters": list(s.parameters),
                 "shared": {name: list(holders) for name, holders in s.shared.items()}, "passes": passes[s.index],
                 "padding_rows": masked[s.index], "sums_as_matmul": sums_as_matmul_applies(cfg),
                 "rewrites": rewrites[s.index]}
                for s in stages
            ],
        }
        (scratch / STAGES_RECORD).write_text(json.dumps(record, indent=1))
    log.info("built %d pipeline stages cut at %s", num, cuts)
    return record
