"""``prepare_data(cfg)``: sources -> checked, shuffled, split Arrow shards + ``manifest.json`` (written last)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from ortflow.config import RunConfig
from ortflow.dataprep.columns import shard_field
from ortflow.dataprep.errors import DataError
from ortflow.dataprep.features import ColumnPlan, resolve, stack
from ortflow.dataprep.loader import verify_data
from ortflow.dataprep.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    InputInfo,
    Manifest,
    read_manifest,
    write_manifest,
)
from ortflow.dataprep.shards import ShardWriter, num_buckets, shard_schema, shuffle_into
from ortflow.dataprep.sources import (
    Source,
    estimate_bytes,
    fingerprint_entry,
    resolve_sources,
    source_columns,
    table_chunks,
    text_windows,
)
from ortflow.dataprep.specs import CONFIGURE_NAME, InputSpec, merges_leading_dims, read_train_inputs
from ortflow.dataprep.tokenizer import TextTokenizer, open_tokenizer, vocab_problem
from ortflow.dataprep.values import ValueRules, check_column, rules_from_record

log = logging.getLogger(__name__)
_STAGING = ".staging"


def prepare_data(cfg: RunConfig) -> Manifest:
    """Write the train/eval shards and ``manifest.json`` into ``cfg.data_dir``; a no-op when nothing changed.

    Dtypes, shapes and columns are checked against the training model's inputs (``configure.json``) on the first
    chunk of every source before any file is written. Old shards stay valid until the new ones are complete.

    Args:
        cfg: the run config (sections ``data`` and ``train.seed`` matter).

    Returns:
        The manifest; ``manifest.reused`` is True when the existing shards were up to date and verified.

    Raises:
        DataError: naming the file or column and the fix.
    """
    specs = read_train_inputs(cfg.output_dir)
    data, data_dir = cfg.data, cfg.data_dir
    train_sources = resolve_sources(data.train, data.format, "data.train", cfg.storage.options)
    test_sources = resolve_sources(data.test, data.format, "data.test", cfg.storage.options) if data.test else []
    text = train_sources[0].format == "text"
    if test_sources and (test_sources[0].format == "text") != text:
        raise DataError("data.test: mixes text and tables with data.train; give both splits the same kind of source")
    record = json.loads((cfg.output_dir / CONFIGURE_NAME).read_text())
    tokenizer = _checked_tokenizer(cfg, record) if text else None
    fingerprint = _fingerprint(cfg, specs, train_sources, test_sources, tokenizer)

    if (data_dir / MANIFEST_NAME).exists():
        try:
            old = read_manifest(data_dir)
            if old.fingerprint == fingerprint:
                verify_data(data_dir)
                for spec, info in zip(specs, old.inputs, strict=True):  # batch sizes are not in the fingerprint
                    for b in {cfg.train.batch_size, cfg.train.resolved_eval_batch_size}:
                        merges_leading_dims(spec, tuple(info.row_shape), b, info.column, _is_label(cfg, spec))
                check_enough_rows(cfg, old.num_rows("train"))
                log.info("data in %s is up to date (fingerprint %s): nothing to do", data_dir, fingerprint[:12])
                return old.with_reused(True)
            log.info("sources or data settings changed: rewriting the shards in %s", data_dir)
        except DataError as err:
            log.warning("rewriting the shards in %s: %s", data_dir, err)

    wanted = column_plan(cfg, specs, text)
    plan: dict[str, ColumnPlan] = {}  # as resolved against the first source; every later source must agree
    dtypes = {s.name: s.dtype for s in specs}
    chunk_bytes = max(1 << 16, data.memory_budget_mb * (1 << 20) // 16)
    rules = rules_from_record(record, cfg.model.loss, cfg.model.ignore_index)

    def stream(sources: list[Source], field: str) -> Iterator[pa.Table]:
        if text:
            first = 0
            encode = tokenizer.encode_lines if tokenizer is not None else None
            for windows in text_windows(sources, data.text.seq_len, encode, chunk_bytes):
                chunk = {data.text.input_name: windows[:, :-1], data.text.label_name: windows[:, 1:]}
                plan.update({n: ColumnPlan(n, (n,), False) for n in wanted})
                yield canonical_table(chunk, plan, dtypes, f"{field} text windows", shapes, rules, first)
                first += len(windows)
        else:
            for source in sources:
                first = 0
                here = resolve_plan(wanted, source, plan)
                needed = sorted({c for p in here.values() for c in p.columns})
                for chunk in table_chunks(source, needed, chunk_bytes):
                    yield canonical_table(chunk, here, dtypes, str(source.path), shapes, rules, first)
                    first += len(next(iter(chunk.values()))) if isinstance(chunk, dict) else chunk.num_rows

    # Check the first chunk of every source before anything is written (shapes are fixed by the first one seen).
    shapes: dict[str, tuple[int, ...]] = {}
    for sources, field in ((train_sources, "data.train"), (test_sources, "data.test")):
        for group in ([sources] if text else [[s] for s in sources]):
            if group:
                next(stream(group, field), None)
    if len(shapes) < len(specs):
        raise DataError(
            "data.train: the text is shorter than one sample (data.text.seq_len + 1 tokens); add text or lower "
            "data.text.seq_len" if text else "data.train: the sources hold no rows; check that the files hold data"
        )
    inputs = []
    for spec in specs:
        label = plan[spec.name].label
        merge = {merges_leading_dims(spec, shapes[spec.name], b, label, _is_label(cfg, spec))
                 for b in {cfg.train.batch_size, cfg.train.resolved_eval_batch_size}}  # fmt: skip
        inputs.append(InputInfo(spec.name, label, spec.dtype, list(spec.shape), list(shapes[spec.name]),
                                merge.pop()))  # fmt: skip
    schema = shard_schema([shard_field(i.name, i.dtype, tuple(i.row_shape)) for i in inputs])

    staging = data_dir / _STAGING
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "buckets").mkdir(parents=True)
    try:
        train_w = ShardWriter(staging, "train", schema, data.rows_per_shard)
        eval_w = ShardWriter(staging, "eval", schema, data.rows_per_shard)
        split_here = not test_sources and data.eval_fraction > 0
        buckets = num_buckets(estimate_bytes(train_sources), data.memory_budget_mb << 20)
        total = shuffle_into(
            stream(train_sources, "data.train"), schema, staging / "buckets", buckets, cfg.train.seed,
            [(eval_w, None), (train_w, None)] if split_here else [(train_w, None)], data.eval_fraction,
        )  # fmt: skip
        for table in stream(test_sources, "data.test") if test_sources else ():
            eval_w.write(table)
        splits = {"train": train_w.close(), "eval": eval_w.close()}
        if not splits["train"]:
            raise DataError(f"data.train: {total} rows leave no training rows; add data or lower data.eval_fraction")
        check_enough_rows(cfg, sum(shard.num_rows for shard in splits["train"]))
        manifest = Manifest(
            format=FORMAT_VERSION,
            fingerprint=fingerprint,
            seed=cfg.train.seed,
            inputs=inputs,
            schema=[{"name": f.name, "type": str(f.type), "row_shape": json.loads(f.metadata[b"row_shape"])}
                    for f in schema],  # fmt: skip
            splits=splits,
            tokens_per_sample=data.text.seq_len if text else None,
            sources={"train": [str(s.path) for s in train_sources], "test": [str(s.path) for s in test_sources]},
        )
        _publish(staging, data_dir, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info(
        "wrote %d train rows in %d shard(s) and %d eval rows in %d shard(s) to %s (%.1f MB)",
        manifest.num_rows("train"), len(splits["train"]), manifest.num_rows("eval"), len(splits["eval"]), data_dir,
        manifest.num_bytes / 1e6,
    )  # fmt: skip
    return manifest


def rows_per_update(cfg: RunConfig) -> int:
    """Training rows one weight update reads over all ranks (a lower bound while num_ranks is auto)."""
    train, dist = cfg.train, cfg.distributed
    if train.global_batch_size:
        return train.global_batch_size
    replicas = dist.resolved_data_parallel_size or 1
    return train.batch_size * train.gradient_accumulation_steps * replicas


def check_enough_rows(cfg: RunConfig, train_rows: int) -> None:
    """Refuse a training split smaller than one weight update's batch (its rows would repeat within the batch).

    Raises:
        DataError: naming the counts and the fix.
    """
    need = rows_per_update(cfg)
    if train_rows < need:
        held = f" after data.eval_fraction {cfg.data.eval_fraction} held rows out for eval" \
            if not cfg.data.test and cfg.data.eval_fraction else ""
        raise DataError(
            f"data.train: {train_rows} training row(s){held}, fewer than the {need} one weight update reads "
            f"(train.batch_size x accumulation x data-parallel ranks); rows would repeat within a batch: add data, "
            f"lower data.eval_fraction or the batch size"
        )


def _checked_tokenizer(cfg: RunConfig, record: dict) -> TextTokenizer | None:
    """The text's tokenizer file (None: byte-level), refused when its ids do not fit an embedding table of the model's
    token input (configure records the tables: ``token_tables`` in configure.json)."""
    if cfg.data.text.tokenizer is None:
        return None
    tokenizer = open_tokenizer(cfg.data.text.tokenizer)
    tables = [tuple(t) for t in record.get("token_tables", {}).get(cfg.data.text.input_name, [])]
    problem = vocab_problem(tokenizer, cfg.data.text.input_name, tables)
    if problem:
        raise DataError(problem)
    return tokenizer


def _fingerprint(cfg: RunConfig, specs: list[InputSpec], train: list[Source], test: list[Source],
                 tokenizer: TextTokenizer | None) -> str:
    """Changes when the sources, the data settings, the tokenizer file's contents, the seed or the model's inputs
    do."""
    key = {
        "format": FORMAT_VERSION,
        "data": cfg.model_dump(mode="json", include={"data"}),
        "tokenizer": tokenizer.digest if tokenizer is not None else None,  # a file rewritten in place re-tokenizes
        "seed": cfg.train.seed,
        "inputs": [asdict(s) for s in specs],
        "train": [fingerprint_entry(s) for s in train],
        "test": [fingerprint_entry(s) for s in test],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def column_plan(cfg: RunConfig, specs: list[InputSpec], text: bool) -> dict[str, str | tuple[str, ...]]:
    """Model input name -> source column, columns or pattern (the text inputs for text corpora)."""
    names = [s.name for s in specs]
    if text:
        fed = {cfg.data.text.input_name, cfg.data.text.label_name}
        for name in sorted(fed - set(names)):
            raise DataError(f"data.text: '{name}' is not an input of the training model (its inputs are {names})")
        for name in names:
            if name not in fed:
                raise DataError(
                    f"model input '{name}' gets no data: text corpora feed only data.text.input_name "
                    f"('{cfg.data.text.input_name}') and data.text.label_name ('{cfg.data.text.label_name}')"
                )
        return {n: n for n in names}
    unknown = sorted(set(cfg.data.columns) - set(names))
    if unknown:
        raise DataError(f"data.columns: {unknown} are not inputs of the training model (its inputs are {names})")
    return {n: cfg.data.columns.get(n, n) for n in names}


def resolve_plan(
    wanted: dict[str, str | tuple[str, ...]], source: Source, first: dict[str, ColumnPlan]
) -> dict[str, ColumnPlan]:
    """The columns each input reads in ``source``; the first source's resolution is stored in ``first``."""
    present = source_columns(source)
    here = {name: resolve(name, spec, present, str(source.path)) for name, spec in wanted.items()}
    for name, plan in here.items():
        seen = first.setdefault(name, plan)
        if seen.columns != plan.columns:
            raise DataError(
                f"data.columns.{name}: {wanted[name]!r} gives columns {list(plan.columns)} in {source.path} but "
                f"{list(seen.columns)} in the first source; every source needs the same feature columns"
            )
    return here


def canonical_table(
    chunk, plan: dict[str, ColumnPlan], dtypes: dict[str, str], where: str, shapes: dict[str, tuple[int, ...]],
    rules: ValueRules, first_row: int,
) -> pa.Table:
    """A source chunk as a table in the shard schema; row shapes must match the first chunk's; values checked."""
    arrays, fields = [], []
    for name, columns in plan.items():
        dtype = dtypes[name]
        # Values are checked before the cast: float64 beyond float32's range is still visible as such.
        for column in columns.columns:
            check_column(chunk[column] if isinstance(chunk, dict) else chunk.column(column), name, rules, column,
                         where, first_row)
        arr, row_shape = stack(chunk, columns, dtype, where)
        if shapes.setdefault(name, row_shape) != row_shape:
            raise DataError(
                f"column '{columns.label}' ({where}) has rows of shape {list(row_shape)}, earlier rows "
                f"{list(shapes[name])}; every row of an input needs the same shape"
            )
        arrays.append(arr)
        fields.append(shard_field(name, dtype, row_shape))
    return pa.Table.from_arrays(arrays, schema=shard_schema(fields))


def _publish(staging: Path, data_dir: Path, manifest: Manifest) -> None:
    """Replace the old shards with the staged ones; the manifest goes first (removed) and last (written)."""
    (data_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for old in [*data_dir.glob("train-*.arrow"), *data_dir.glob("eval-*.arrow")]:
        old.unlink()
    for shards in manifest.splits.values():
        for shard in shards:
            (staging / shard.file).replace(data_dir / shard.file)
    write_manifest(manifest, data_dir)


def _is_label(cfg: RunConfig, spec: InputSpec) -> bool:
    """Whether ``spec`` is the label the loss adds (not an input of the user's model)."""
    return cfg.model.loss != "model_output" and spec.name == cfg.model.label_input
