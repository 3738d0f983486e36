"""``ortflow validate``: every problem that can be found without training, all at once.

Checks, in order (each problem names the field and the fix):

1. the YAML, every field and the cross-field rules; the model file, host file and tokenizer exist (config.py);
2. the model against the loss: the loss output exists, its dtype and rank fit the loss (``[N, C]`` or
   ``[B, T, V]`` for cross_entropy), the label name is free;
3. the data: every source pattern matches files, every column (or feature pattern) exists in every source, and the
   first rows of each source fit the training model's inputs (dtypes, per-row shapes) at ``train.batch_size`` and
   ``train.eval_batch_size``, fixed batch dims included (after the batch pass of ortflow/graph/exports/batch_dims.py, so
   a batch dim counts as fixed only when the graph really depends on it); a text corpus's tokenizer is a ``tokenizers``
   JSON file whose ids fit the embedding table the token input indexes (ortflow/dataprep/tokenizer.py);
4. the layout: ``train.global_batch_size`` against the model's fixed batch dim, the ranks and the stages, with the
   messages ``ortflow train`` would give (and the data checks then use the ranks' real micro-batch);
5. the run folder, checkpoint, TensorBoard and export paths can be written;
6. ``versions.policy continue`` against the newest completed version in ``output_dir``, as a new version's run
   checks it;
7. ``optimizer.groups`` against the parameters configure will train (patterns that match nothing or only parameters
   of an earlier group);
8. with pipeline stages or tensor-parallel pieces: the split configure makes, refused as configure refuses it (the
   plan, in words, is what ``ortflow validate`` prints for a valid config: what is split how, what stays replicated);
9. with ``deep``: the engine builds what configure builds (the whole model's training artifacts, and every pipeline
   stage and tensor-parallel piece) in a temporary folder, so gradient-builder failures (operators without
   gradients, ...) show up, and the data checks use the built model's real inputs; with ``distributed.device: cuda``
   also every node of the built training model that runs in fp16/bf16 where the GPU engine has no CUDA kernel for it
   (ortflow/graph/precision/cuda_kernels.py), and, where validate runs with the GPU engine installed, the CUDA libraries
   a rank would not find (cuDNN's convolution library for a model with ``Conv`` nodes, ...): each would stop every rank
   at start.

The training model's inputs without ``deep`` are predicted: the model's inputs plus the label the loss adds
(int64 with the logits' leading dims for cross_entropy, the output's dtype and shape for the other losses).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper

from ortflow.config import RunConfig, find_problems, param_group_problems
from ortflow.dataprep.errors import DataError
from ortflow.dataprep.features import ColumnPlan
from ortflow.dataprep.preparation import canonical_table, check_enough_rows, column_plan, resolve_plan
from ortflow.dataprep.sources import Source, count_rows, resolve_sources, source_size, table_chunks, text_windows
from ortflow.dataprep.specs import InputSpec, merges_leading_dims
from ortflow.dataprep.tokenizer import open_tokenizer, vocab_problem
from ortflow.dataprep.values import ValueRules
from ortflow.graph.exports.batch_dims import make_batch_symbolic
from ortflow.graph.exports.external_data import data_bytes, needs_external_data, proto_bytes

if TYPE_CHECKING:
    from ortflow.storage import RemoteDir

log = logging.getLogger(__name__)

#: Sources whose column names are read; the rows of only the first source of each split are checked.
MAX_SOURCES_CHECKED = 64
_FIRST_ROWS_BYTES = 1 << 20


def validate(path: Path | str, overrides: list[str] | tuple[str, ...] = (), deep: bool = False,
             split_plan: list[str] | None = None) -> list[str]:
    """Every problem with a config, its model, data and paths (empty when it is valid).

    Args:
        path: The config file.
        overrides: ``--set`` overrides.
        deep: Also build the training artifacts in a temporary folder (seconds to minutes for large models).
        split_plan: When given, the pipeline / tensor-parallel split plan in words is appended to it (what is split
            how, what stays replicated and why, what the parts do with their activations), for a layout that splits
            the model.
    """
    cfg, problems = find_problems(path, overrides)
    if cfg is None:
        return problems
    specs = None
    if not any(p.startswith("model.path") for p in problems):
        specs, model_problems = predicted_inputs(cfg)
        model_problems += torch_problems(cfg) if not model_problems else []
        problems += model_problems
        split = cfg.distributed.horizontal_parallel_size > 1 or cfg.distributed.pipeline_parallel_size > 1
        if split and not model_problems:
            model_problems = tensor_parallel_problems(cfg, split_plan)
            problems += model_problems
        if (cfg.optimizer.groups or cfg.tensorboard.histogram_names) and not model_problems:
            problems += group_problems(cfg)
        if deep and not model_problems:
            built, deep_problems = build_in_temporary_folder(cfg)
            problems += deep_problems
            specs = built or specs
    layout, train_batch = layout_problems(cfg, specs)
    problems += layout
    problems += data_problems(cfg, specs, train_batch)
    problems += path_problems(cfg)
    problems += resume_layout_problems(cfg)
    problems += store_problems(cfg)
    problems += version_problems(cfg)
    return list(dict.fromkeys(problems))  # the same problem found twice is listed once


def _spec(info: onnx.ValueInfoProto) -> InputSpec:
    tensor = info.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name if tensor.elem_type else "float32"
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim)
    return InputSpec(info.name, dtype, dims)


def tensor_parallel_problems(cfg: RunConfig, split_plan: list[str] | None = None) -> list[str]:
    """The pipeline or tensor-parallel split's refusal (a cut crossed by a value computed from trained parameters, a
    size that does not divide the heads, nothing to split, a cut inside a split region, a tied weight across stages),
    exactly as configure gives it (:func:`ortflow.configure.configure.plan_layout`); onnx only, no engine. The plan in
    words goes into ``split_plan`` when given."""
    from ortflow.configure.artifacts import ArtifactsError
    from ortflow.configure.configure import plan_layout
    from ortflow.graph.exports.batchnorm_stats import running_statistics, to_record
    from ortflow.trainer.batchnorm import refuse_tensor_parallel

    if cfg.distributed.horizontal_parallel_size > 1:
        try:
            refuse_tensor_parallel(to_record(running_statistics(cfg.model.path)))  # as the tensor-parallel ranks do
        except ValueError as err:
            return [str(err)]
    from ortflow.configure.torch_model import torch_source

    try:
        with tempfile.TemporaryDirectory(prefix="ortflow-validate-") as tmp:
            built_cfg, _ = torch_source(cfg, Path(tmp))  # a dynamo export is split as configure splits it
            plan_layout(built_cfg, split_plan)
    except (ArtifactsError, ValueError) as err:
        return [str(err)]
    return []


def torch_problems(cfg: RunConfig) -> list[str]:
    """A dynamo export whose torch parameters the exporter merged or dropped beyond repair, refused as configure
    refuses it (with the export call that keeps them); nothing for other exports."""
    from ortflow.configure.artifacts import ArtifactsError
    from ortflow.configure.torch_model import read_torch_parameters

    try:
        read_torch_parameters(cfg.model.path)
    except ArtifactsError as err:
        return [str(err)]
    return []


def group_problems(cfg: RunConfig) -> list[str]:
    """optimizer.groups and tensorboard.histogram_names against the parameters configure will train (float
    initializers outside model.frozen, less those the engine cannot train: running statistics and constants), as
    configure checks the groups; the histograms show trained parameters only."""
    from fnmatch import fnmatch

    from ortflow.configure.torch_model import read_torch_parameters
    from ortflow.graph.exports.untrainable import untrainable_initializers

    found = read_torch_parameters(cfg.model.path)  # a dynamo export trains its torch parameters, by torch name
    proto = onnx.load(str(cfg.model.path), load_external_data=False) if found is None else found.model
    floats = {t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
              and (found is None or t.name in found.trained)
              and not any(fnmatch(t.name, pattern) for pattern in cfg.model.frozen)}
    trainable = sorted(floats - set(untrainable_initializers(proto, floats)))
    examples = ", ".join(repr(n) for n in trainable[:3])
    histograms = [f"tensorboard.histogram_names: '{pattern}' matches no trained parameter; fix the pattern "
                  f"(parameters are named as in the ONNX model, e.g. {examples})"
                  for pattern in cfg.tensorboard.histogram_names
                  if not any(fnmatch(n, pattern) for n in trainable)]
    return param_group_problems(trainable, cfg.optimizer) + histograms


def predicted_inputs(cfg: RunConfig) -> tuple[list[InputSpec] | None, list[str]]:
    """The training model's inputs as configure will build them (label included), and loss/output problems."""
    model = cfg.model
    try:
        proto = load_model(model.path)
    except Exception as err:  # noqa: BLE001 - onnx raises several types (external data, protobuf)
        return None, [f"model.path: cannot load {model.path} with its weights ({type(err).__name__}: {err})"]
    proto, _ = make_batch_symbolic(proto)
    inits = {t.name for t in proto.graph.initializer}
    inputs = [_spec(i) for i in proto.graph.input if i.name not in inits]
    outputs = {o.name: _spec(o) for o in proto.graph.output}
    if not outputs:
        return None, ["model.path: the model has no outputs"]
    name = model.loss_output or next(iter(outputs))
    out = outputs.get(name)
    if out is None:
        return None, [f"model.loss_output: '{name}' is not a model output; outputs are {list(outputs)}"]
    if model.loss == "model_output":
        if out.shape not in ((), (1,)):
            return None, [f"model.loss_output: '{name}' must be a scalar loss for model.loss model_output, but its "
                          f"shape is {list(out.shape)}"]  # fmt: skip
        return inputs, []
    problems = []
    if out.dtype != "float32":
        problems.append(f"model.loss_output: '{name}' is {out.dtype}; the engine's losses need float32")
    if model.loss == "cross_entropy":
        if out.shape and len(out.shape) not in (2, 3):
            problems.append(
                f"model.loss cross_entropy needs scores [N, C] or [B, T, V], but '{name}' has shape "
                f"{list(out.shape)}; pick the output holding the class scores in model.loss_output"
            )
        label = InputSpec(model.label_input, "int64", out.shape[:-1])
    else:
        label = InputSpec(model.label_input, out.dtype, out.shape)
    clash = next((i for i in inputs if i.name == model.label_input), None)
    if clash is not None:
        problems.append(
            f"model.label_input: the model already has an input '{clash.name}'; the loss adds its own "
            f"'{model.label_input}' input: set model.label_input to another name"
        )
    return (None if problems else [*inputs, label]), problems


def load_model(path: Path) -> onnx.ModelProto:
    """The model with its weights when they fit in one proto (the batch pass test-runs it); past 2 GB its graph,
    the weights left in their files, as configure reads it (:mod:`ortflow.graph.exports.external_data`)."""
    proto = onnx.load(str(path), load_external_data=False)
    if not needs_external_data(proto_bytes(proto), data_bytes(path, proto)):
        onnx.external_data_helper.load_external_data_for_model(proto, str(Path(path).parent))
    return proto


def build_in_temporary_folder(cfg: RunConfig) -> tuple[list[InputSpec] | None, list[str]]:
    """Build what configure builds (the whole model's artifacts, and the pipeline stages and tensor-parallel pieces
    of the configured layout) in a temporary folder; (the real train inputs, problems)."""
    from ortflow.configure.configure import build_layout  # the engine: only for --deep

    problems = []
    with tempfile.TemporaryDirectory(prefix="ortflow-validate-") as tmp:
        folder = Path(tmp) / "artifacts"
        folder.mkdir()
        try:
            built, _, _ = build_layout(cfg, folder)
        except Exception as err:  # noqa: BLE001 - ArtifactsError, and whatever else the engine raises
            return None, [str(err)]
        if cfg.distributed.device == "cuda":
            problems = cuda_kernel_problems(folder) + cuda_library_problems(cfg.model.path)
    return [InputSpec(t.name, t.dtype, tuple(d if d is not None else "?" for d in t.shape))
            for t in built.train_inputs], problems  # fmt: skip


def cuda_library_problems(model_path: Path) -> list[str]:
    """The CUDA libraries a rank of this model would not find here, as the rank refuses them
    (:func:`ortflow.trainer.startup.select_device`); nothing where the GPU engine is not installed (a host that only
    launches cannot tell what the GPU hosts have)."""
    import onnxruntime

    from ortflow import cuda_libs
    from ortflow.configure.configure import op_types

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return []
    report = cuda_libs.preload()
    problems = [f"distributed.device: the GPU engine needs {name}, not found here: install ortflow's `cuda` extra or "
                f"name its folder in {cuda_libs.ENV_DIRS} (`ortflow doctor` lists what is found)"
                for name in report.missing if name in cuda_libs.ENGINE_LIBRARIES]  # fmt: skip
    for what, ops, absent in cuda_libs.missing_for_ops(op_types(model_path), report):
        problems.append(f"model.path: its {'/'.join(ops)} nodes need cuDNN's {what} library ({', '.join(absent)}), "
                        f"not found here: install nvidia-cudnn-cu11 (ortflow's `cuda` extra) or name its folder in "
                        f"{cuda_libs.ENV_DIRS}")
    return problems


def cuda_kernel_problems(artifacts: Path) -> list[str]:
    """The nodes that the GPU engine has no half-precision CUDA kernel for, in every training model built under
    ``artifacts`` (the whole model's, and each pipeline stage's and tensor-parallel piece's, named by its folder)."""
    from ortflow.graph.precision.cuda_kernels import missing_kernels

    problems = []
    for path in sorted(Path(artifacts).rglob("training_model.onnx"), key=lambda p: (len(p.parts), p)):
        part = path.parent.relative_to(artifacts).as_posix()
        where = "" if part == "." else f" (in {part})"
        proto = onnx.load(str(path), load_external_data=False)
        problems += [f"model.path{where}: {m.message()}" for m in missing_kernels(proto)]
    return problems


def _sources(cfg: RunConfig) -> tuple[dict[str, list[Source]], list[str]]:
    found: dict[str, list[Source]] = {"data.train": [], "data.test": []}
    problems = []
    for field, patterns in (("data.train", cfg.data.train), ("data.test", cfg.data.test)):
        for pattern in patterns:  # one at a time, so every pattern that matches nothing is listed
            try:
                found[field] += resolve_sources((pattern,), cfg.data.format, field, cfg.storage.options)
            except DataError as err:
                problems.append(str(err))
    return found, problems


def layout_problems(cfg: RunConfig, specs: list[InputSpec] | None) -> tuple[list[str], int | None]:
    """What the launcher and the ranks refuse about the global batch, the model's fixed batch dim, the ranks and the
    stages, with their own messages; and the per-rank micro-batch the ranks will use (None: not known before launch).

    With ``train.global_batch_size`` the ranks split it over the data-parallel replicas (``num_ranks`` / (pipeline x
    tensor-parallel sizes)) as the ranks do (``plan_batch``): micro-batches of exactly the fixed batch dim, if any.
    """
    from ortflow.config import LayoutError, nearest_multiples, plan_batch

    train, dist = cfg.train, cfg.distributed
    if specs is None:
        return [], train.batch_size
    label = cfg.model.label_input if cfg.model.loss != "model_output" else None
    fixed = sorted({s.shape[0] for s in specs if s.name != label and s.shape and isinstance(s.shape[0], int)
                    and s.shape[0] > 0})
    if len(fixed) > 1:
        return [f"model.path: model inputs fix different batch sizes {fixed}; re-export with one batch dim"], None
    unit = fixed[0] if fixed else None
    if not train.global_batch_size:
        return [], train.batch_size
    if dist.num_ranks == "auto":  # the launcher picks the rank count; the global batch must hold whole batches
        if unit and train.global_batch_size % unit:
            return [f"train.global_batch_size {train.global_batch_size} is not a multiple of the model's fixed batch "
                    f"dim {unit}: use {', '.join(map(str, nearest_multiples(train.global_batch_size, unit)))}"], None
        return [], unit
    replicas = dist.num_ranks // (dist.pipeline_parallel_size * dist.horizontal_parallel_size)
    try:
        plan = plan_batch(train.global_batch_size, replicas, train.batch_size, unit)
    except LayoutError as err:
        return [str(err)], None
    return [], plan.batch_size


def data_problems(cfg: RunConfig, specs: list[InputSpec] | None, train_batch: int | None = -1) -> list[str]:
    """Sources, columns, and the first rows' dtypes and shapes against the inputs at both batch sizes
    (``train_batch``: the ranks' micro-batch, default ``train.batch_size``; None: not known, not checked)."""
    sources, problems = _sources(cfg)
    if specs is None:
        return problems
    text = any(s.format == "text" for group in sources.values() for s in group)
    if text:
        problems += tokenizer_problems(cfg)
    try:
        wanted = column_plan(cfg, specs, text)
    except DataError as err:
        return [*problems, str(err)]
    dtypes = {s.name: s.dtype for s in specs}
    rules = ValueRules(
        cfg.model.label_input if cfg.model.loss == "cross_entropy" else None, None, cfg.model.ignore_index,
        frozenset(s.name for s in specs if s.dtype.startswith("float")),
    )
    for field, group in sources.items():
        shapes: dict[str, tuple[int, ...]] = {}
        plan: dict[str, ColumnPlan] = {}
        try:
            if text and group:
                windows = next(text_windows(group[:1], cfg.data.text.seq_len, None, _FIRST_ROWS_BYTES), None)
                if windows is not None:
                    shapes = {n: (cfg.data.text.seq_len,) for n in wanted}
                    plan = {n: ColumnPlan(n, (n,), False) for n in wanted}
            for source in [] if text else group[:MAX_SOURCES_CHECKED]:  # every source, as prepare-data reads them
                problems += _source_problems(source, resolve_plan(wanted, source, plan), dtypes, shapes, rules)
        except DataError as err:
            problems.append(str(err))
            continue
        if field == "data.train" and group and plan:
            problems += _row_count_problems(cfg, group, text, next(iter(plan.values())).columns[0])
        for spec in specs:
            if spec.name not in shapes:
                continue
            column = plan[spec.name].label
            is_label = cfg.model.loss != "model_output" and spec.name == cfg.model.label_input
            train_batch = cfg.train.batch_size if train_batch == -1 else train_batch
            for batch in sorted({b for b in (train_batch, cfg.train.resolved_eval_batch_size) if b is not None}):
                try:
                    merges_leading_dims(spec, shapes[spec.name], batch, column, is_label)
                except DataError as err:
                    problems.append(f"{field}: {err}")
    return problems


def tokenizer_problems(cfg: RunConfig) -> list[str]:
    """The text's tokenizer file: a ``tokenizers`` JSON file (``tokenizers`` installed), whose ids fit every embedding
    table the model's token input (``data.text.input_name``) indexes."""
    from ortflow.graph.exports.token_tables import token_tables

    path = cfg.data.text.tokenizer
    if path is None or not path.exists():
        return []  # byte-level, or a missing file reported with the other files (ortflow/config/files.py)
    try:
        tokenizer = open_tokenizer(path)
    except DataError as err:
        return [str(err)]
    try:
        tables = token_tables(onnx.load(str(cfg.model.path), load_external_data=False))
    except Exception:  # noqa: BLE001 - an unloadable model is reported by the model checks
        return []
    problem = vocab_problem(tokenizer, cfg.data.text.input_name, tables.get(cfg.data.text.input_name, []))
    return [problem] if problem else []


def _source_problems(source: Source, here: dict[str, ColumnPlan], dtypes: dict[str, str],
                     shapes: dict[str, tuple[int, ...]], rules: ValueRules) -> list[str]:
    """The first rows of one source against the inputs, each input on its own so that every problem is named: dtypes,
    row shapes (equal to the earlier sources'), values (labels in range, finite floats)."""
    needed = sorted({c for p in here.values() for c in p.columns})
    chunk = next(table_chunks(source, needed, _FIRST_ROWS_BYTES), None)
    if chunk is None:
        return []
    problems = []
    for name, columns in here.items():
        try:
            canonical_table(chunk, {name: columns}, dtypes, str(source.path), shapes, rules, 0)
        except DataError as err:
            problems.append(str(err))
    return problems


def _row_count_problems(cfg: RunConfig, sources: list[Source], text: bool, column: str) -> list[str]:
    """prepare-data's refusal of too few training rows for one weight update, from the sources' row counts."""
    if text:
        if cfg.data.text.tokenizer is not None:
            return []  # the window count needs the whole corpus tokenized: prepare-data checks it
        total = sum(source_size(s) for s in sources) // (cfg.data.text.seq_len + 1)
    else:
        try:
            total = sum(count_rows(s, column) for s in sources)
        except DataError as err:
            return [str(err)]
    held = round(total * cfg.data.eval_fraction) if not cfg.data.test and cfg.data.eval_fraction > 0 else 0
    try:
        check_enough_rows(cfg, total - held)
    except DataError as err:
        return [str(err)]
    return []


def version_problems(cfg: RunConfig) -> list[str]:
    """``versions.policy continue`` against the newest completed version in ``output_dir`` (as a new version's run
    would check it): the model file or the model or optimizer sections changed."""
    from ortflow.versions import continue_problems, last_completed

    if cfg.versions.policy != "continue":
        return []
    try:
        return continue_problems(cfg, last_completed(cfg.output_dir))
    except (DataError, OSError):  # a source or the model is missing: reported by the checks above
        return []


def _not_writable(folder: Path) -> str:
    """Why a folder refuses writing: its file system is mounted read-only, or its permissions."""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return "is on a read-only file system; choose another path"
    return "is not writable; fix its permissions or choose another path"


def _writable(path: Path, field: str, is_dir: bool) -> str | None:
    """Why ``path`` cannot be created or written, or None."""
    if path.exists():
        if is_dir and not path.is_dir():
            return f"{field}: {path} is a file, not a folder; choose a folder path"
        if not is_dir and path.is_dir():
            return f"{field}: {path} is a folder; give the file to write, e.g. {path / 'model.onnx'}"
        target = path if is_dir else path.parent
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{field}: {target} {_not_writable(target)}"
        try:  # permissions are not the whole story (root, /sys, a full or read-only mount): try, and remove the try
            handle, probe = tempfile.mkstemp(prefix=".ortflow-probe-", dir=target)
        except OSError as err:
            return f"{field}: {target} takes no new files ({err.strerror}); choose another path"
        os.close(handle)
        os.unlink(probe)
        return None
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{field}: cannot create {path}: {parent} is a file, not a folder; choose another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{field}: cannot create {path}: {parent} {_not_writable(parent)}"
    try:  # permissions are not the whole story (/proc, /sys, a full or read-only mount): try, and remove the try
        os.rmdir(tempfile.mkdtemp(prefix=".ortflow-probe-", dir=parent))
    except OSError as err:
        return (f"{field}: cannot create {path}: {parent} does not take new folders ({err.strerror}); choose another "
                "path")
    return None


def resume_layout_problems(cfg: RunConfig) -> list[str]:
    """The checkpoint training would resume, written with another pipeline or tensor-parallel size or holding an
    optimizer state this config's optimizer cannot continue: the ranks refuse it at start, so it is a problem now
    (:func:`~ortflow.checkpoints.layout_check.resume_layout_refusal`)."""
    from ortflow.checkpoints.layout_check import resume_layout_refusal

    refusal = resume_layout_refusal(cfg)
    return [f"checkpoint: {refusal}"] if refusal else []


def path_problems(cfg: RunConfig) -> list[str]:
    """The run folder and the checkpoint, TensorBoard and export paths must be writable."""
    return [*_path_problems([(cfg.output_dir, "output_dir", True)]), *training_path_problems(cfg),
            *_path_problems([(cfg.export_path, "export.path", False)])]


def training_path_problems(cfg: RunConfig) -> list[str]:
    """The folders the ranks write, checked before they start (``ortflow train``, the train stage): the checkpoint
    and TensorBoard folders must be writable (a file is written there and removed)."""
    return _path_problems([(cfg.checkpoints_dir, "checkpoint.dir", True),
                           (cfg.tensorboard_dir, "tensorboard.log_dir", True)])


def _path_problems(checks: list[tuple[Path, str, bool]]) -> list[str]:
    return [p for p in (_writable(Path(path), field, is_dir) for path, field, is_dir in checks) if p]


def store_problems(cfg: RunConfig, remote: RemoteDir | None = None) -> list[str]:
    """A remote ``output_dir`` must be reachable, accept this process's credentials and have its bucket (read-only
    requests, no retries; nothing is created). ``remote`` is the run folder on the store (default: from the config).
    """
    if cfg.storage.remote_dir is None:
        return []
    from ortflow.storage import RemoteDir, StorageAccessDenied
    from ortflow.storage.remote_dir import CREDENTIALS

    url = cfg.storage.remote_dir
    scheme = url.split(":", 1)[0]
    try:
        remote = remote or RemoteDir(url, cfg.storage.options, retries=0)
        remote.check_bucket()
    except FileNotFoundError:
        make = {"s3": f"aws s3 mb s3://{remote.bucket}", "gs": f"gcloud storage buckets create gs://{remote.bucket}"}
        how = make.get(scheme, f"az storage container create --name {remote.bucket}")
        return [f"output_dir: {url}: the bucket {remote.bucket} does not exist on this store; create it ({how}, or "
                "in the store's console; ortflow creates no bucket) or correct the bucket in output_dir"]
    except StorageAccessDenied as err:
        cause = err.__cause__ or err
        return [f"output_dir: {url}: the store refused this process's credentials ({type(cause).__name__}: "
                f"{_one_line(cause)}); check {CREDENTIALS.get(scheme, CREDENTIALS['az'])} and the bucket's access "
                "policy (docs/operations.md, Remote storage)"]
    except Exception as err:  # noqa: BLE001 - StorageError (unreachable), a missing package
        cause = err.__cause__ or err
        return [f"output_dir: cannot reach {url} ({type(cause).__name__}: {_one_line(cause)}); check the endpoint "
                "(AWS_ENDPOINT_URL or storage.options.endpoint_url), the network and the credentials "
                "(docs/operations.md, Remote storage)"]
    return []


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
