"""Value checks on the data before it is sharded: data that would train a wrong model is refused.

The engine does not check values. A class label outside ``[0, C)`` makes its cross-entropy read another row's score
(or past the end of the buffer, which can crash a rank), label -1 is silently dropped, and a NaN, an infinity or a
float64 value beyond float32's range in a feature trains to NaN losses. Every check names the file, the column, the
rows and the fix.

The rules come from the run folder's ``configure.json`` (which input is the label, how many classes the loss
output has) and the config (``model.ignore_index``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ortflow.dataprep.errors import DataError

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class ValueRules:
    """What the values of each model input must satisfy.

    Attributes:
        label_input: The cross_entropy label input (None for other losses).
        num_classes: Classes of the loss output's last dim (None when the model leaves it symbolic).
        ignore_index: The one label value the loss skips on purpose (``model.ignore_index``), or None.
        float_inputs: Inputs with a floating dtype (checked for NaN, infinities and float32 overflow).
    """

    label_input: str | None
    num_classes: int | None
    ignore_index: int | None
    float_inputs: frozenset[str]


def rules_from_record(record: dict | None, loss: str, ignore_index: int | None) -> ValueRules:
    """The rules for a configured run, from its ``configure.json`` record and the config's loss settings."""
    record = record or {}
    floats = frozenset(
        i["name"] for i in record.get("train_inputs", []) if np.dtype(i.get("dtype", "int64")).kind == "f"
    )
    label = record.get("label_input") if loss == "cross_entropy" else None
    classes = None
    if label is not None:
        output = next((o for o in record.get("model_outputs", []) if o["name"] == record.get("loss_output")), None)
        last = output["shape"][-1] if output and output.get("shape") else None
        classes = last if isinstance(last, int) and last > 0 else None
    return ValueRules(label, classes, ignore_index, floats)


def _flat_values(arr: pa.Array) -> tuple[np.ndarray, int]:
    """The values of a (nested) list column as one numpy array, and the number of values per row."""
    per_row = 1
    while pa.types.is_fixed_size_list(arr.type) or pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        if pa.types.is_fixed_size_list(arr.type):
            per_row *= arr.type.list_size
        elif len(arr):
            per_row *= int(pc.list_value_length(arr)[0].as_py())
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False), max(per_row, 1)


def _rows(bad: np.ndarray, per_row: int, first_row: int) -> str:
    """'rows a..b (n values)' for the positions of bad values in a flat array."""
    rows = bad // per_row + first_row
    span = f"row {rows[0]}" if rows[0] == rows[-1] else f"rows {rows[0]}..{rows[-1]}"
    return f"{span} ({bad.size} value(s))"


def check_labels(values: np.ndarray, per_row: int, rules: ValueRules, column: str, where: str, first_row: int) -> None:
    """Refuse class labels outside ``[0, num_classes)`` other than ``ignore_index``."""
    valid = values >= 0
    if rules.num_classes is not None:
        valid &= values < rules.num_classes
    if rules.ignore_index is not None:
        valid |= values == rules.ignore_index
    bad = np.flatnonzero(~valid)
    if not bad.size:
        return
    sample = sorted({int(v) for v in values[bad[:1000]]})[:5]
    allowed = f"0..{rules.num_classes - 1}" if rules.num_classes is not None else ">= 0"
    fix = (
        f"fix or drop those rows; if {sample[0]} marks rows the loss should skip, set model.ignore_index: {sample[0]}"
        if len(sample) == 1 and rules.ignore_index is None
        else "fix or drop those rows (model.ignore_index names one label value the loss skips)"
    )
    raise DataError(
        f"column '{column}' ({where}): class labels {sample} at {_rows(bad, per_row, first_row)} are outside "
        f"{allowed} (the model's loss output has {rules.num_classes or 'an unknown number of'} classes); the engine "
        f"would read another row's score or crash; {fix}"
    )


def check_floats(values: np.ndarray, per_row: int, column: str, where: str, first_row: int) -> None:
    """Refuse NaN, infinities and values beyond float32's range (which the cast would turn into infinities)."""
    if values.dtype.kind != "f":
        return
    finite = np.isfinite(values)
    bad = np.flatnonzero(~finite)
    if bad.size:
        kinds = sorted({"nan" if np.isnan(v) else "inf" for v in values[bad[:1000]]})
        raise DataError(
            f"column '{column}' ({where}): non-finite values ({', '.join(kinds)}) at {_rows(bad, per_row, first_row)}; "
            f"training on them gives NaN losses: fill or drop those rows in the source"
        )
    if values.dtype.itemsize > 4:
        big = np.flatnonzero(np.abs(values) > _FLOAT32_MAX)
        if big.size:
            raise DataError(
                f"column '{column}' ({where}): values up to {float(np.abs(values[big]).max()):.3g} at "
                f"{_rows(big, per_row, first_row)} exceed float32's range (3.4e38) and would become infinities: "
                f"rescale the column (e.g. standardize it) in the source"
            )


def _check_nulls(source: pa.Array, column: str, where: str, first_row: int) -> None:
    """Refuse missing values (a JSON ``null``, an empty CSV cell), naming the first rows that lack one."""
    if not source.null_count:
        return
    rows = np.flatnonzero(pc.is_null(source).to_numpy(zero_copy_only=False))
    raise DataError(
        f"column '{column}' ({where}): missing (null) values at {_rows(rows, 1, first_row)}; fill or drop those rows "
        f"in the source"
    )


def check_column(source: pa.Array | pa.ChunkedArray | np.ndarray, name: str, rules: ValueRules, column: str,
                 where: str, first_row: int) -> None:
    """Check one source column (before its cast to the model's dtype) that feeds model input ``name``.

    Args:
        source: The column as read from the file (an Arrow column or a numpy array of rows).
        name: The model input it feeds.
        rules: What the values must satisfy.
        column: The source column's name (named in errors).
        where: The file (named in errors).
        first_row: Row number of the column's first row within the file (named in errors).

    Raises:
        DataError: naming the file, column, rows and the fix.
    """
    if name != rules.label_input and name not in rules.float_inputs:
        return
    if isinstance(source, np.ndarray):
        values, per_row = source.reshape(-1), int(np.prod(source.shape[1:], dtype=np.int64)) or 1
    else:
        if isinstance(source, pa.ChunkedArray):
            source = source.combine_chunks()
        _check_nulls(source, column, where, first_row)
        values, per_row = _flat_values(source)
    if values.dtype == object or values.dtype.kind not in "biuf":
        return  # the dtype check that follows names a non-numeric column
    if name == rules.label_input:
        if values.dtype.kind == "f":  # labels written as floats ("1.0"): NaN or infinity is no class
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                raise DataError(
                    f"column '{column}' ({where}): class labels NaN or infinite at {_rows(bad, per_row, first_row)}; "
                    f"every row needs a whole-number class: fill or drop those rows in the source"
                )
        check_labels(values, per_row, rules, column, where, first_row)
    else:
        check_floats(values, per_row, column, where, first_row)


def scan_sources(cfg) -> list[str]:
    """Every value problem in a configured run's table sources, for ``ortflow validate`` ([] before configure).

    Reads each source once (labels and float columns only); one problem per file at most.
    """
    from ortflow.dataprep.features import resolve
    from ortflow.dataprep.sources import resolve_sources, source_columns, table_chunks
    from ortflow.dataprep.specs import CONFIGURE_NAME

    try:
        record = json.loads((cfg.output_dir / CONFIGURE_NAME).read_text())
    except (OSError, ValueError):
        return []  # not configured yet: the class count is unknown; prepare-data checks every value anyway
    rules = rules_from_record(record, cfg.model.loss, cfg.model.ignore_index)
    wanted = {spec["name"]: cfg.data.columns.get(spec["name"], spec["name"]) for spec in record.get("train_inputs", [])
              if spec["name"] == rules.label_input or spec["name"] in rules.float_inputs}
    problems: list[str] = []
    for patterns, field in ((cfg.data.train, "data.train"), (cfg.data.test, "data.test")):
        try:
            sources = resolve_sources(patterns, cfg.data.format, field, cfg.storage.options) if patterns else []
        except DataError as err:
            problems.append(str(err))
            continue
        for source in sources:
            if source.format == "text" or not wanted:
                continue
            first = 0
            try:
                # the columns as prepare-data resolves them: a name, a list of names or a pattern ('f*')
                present = source_columns(source)
                plan = {name: resolve(name, spec, present, str(source.path)).columns for name, spec in wanted.items()}
                needed = sorted({c for columns in plan.values() for c in columns})
                for chunk in table_chunks(source, needed, 1 << 24):
                    for name, columns in plan.items():
                        for column in columns:
                            values = chunk[column] if isinstance(chunk, dict) else chunk.column(column)
                            check_column(values, name, rules, column, str(source.path), first)
                    first += len(next(iter(chunk.values()))) if isinstance(chunk, dict) else chunk.num_rows
            except DataError as err:
                problems.append(str(err))
    return problems
