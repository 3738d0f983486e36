"""Vector inputs from several columns: ``data.columns`` maps an input to one column, a list, or a glob.

``columns: {features: "f*"}`` expands the glob against each source's column names in natural order (``f0, f1, ...,
f9, f10``, not ``f0, f1, f10, f2``); ``columns: {features: [x, y, z]}`` names them. Each named column must hold
one scalar per row; the row of the input is the columns stacked in that order (row shape ``[k]``), so a CSV with
one column per feature feeds a ``[B, k]`` input exactly as a Parquet list column of the same values does.
"""

from __future__ import annotations

import fnmatch
import glob
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ortflow.dataprep.columns import arrow_to_canonical, numpy_to_canonical
from ortflow.dataprep.errors import DataError


@dataclass(frozen=True)
class ColumnPlan:
    """How one model input reads its source: a single column (``stacked`` False) or several stacked ones."""

    input_name: str
    columns: tuple[str, ...]
    stacked: bool

    @property
    def label(self) -> str:
        """The columns as named in messages and the manifest."""
        if not self.stacked:
            return self.columns[0]
        if len(self.columns) <= 4:
            return ",".join(self.columns)
        return f"{self.columns[0]},...,{self.columns[-1]} ({len(self.columns)} columns)"


def natural_key(name: str) -> list:
    """Sort key putting ``f2`` before ``f10``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def resolve(input_name: str, spec: str | tuple[str, ...], present: list[str], where: str) -> ColumnPlan:
    """The columns ``spec`` names among ``present`` (a source's columns).

    Args:
        input_name: The model input (named in errors).
        spec: One column, a glob pattern, or a list of columns / patterns.
        present: The source's column names.
        where: The source, for messages.

    Raises:
        DataError: a named column is missing, or a pattern matches no column.
    """
    items = [spec] if isinstance(spec, str) else list(spec)
    stacked = not isinstance(spec, str) or glob.has_magic(spec)
    columns: list[str] = []
    for item in items:
        if glob.has_magic(item):
            matched = sorted(fnmatch.filter(present, item), key=natural_key)
            if not matched:
                raise DataError(
                    f"data.columns.{input_name}: pattern '{item}' matches no column of {where} (it has {present}); "
                    "fix the pattern"
                )
            columns.extend(matched)
        elif item in present:
            columns.append(item)
        else:
            raise DataError(
                f"{where}: no column '{item}' for model input '{input_name}' (it has {present}); map model inputs to "
                "source columns with data.columns: {input_name: column, [columns] or 'pattern*'}"
            )
    return ColumnPlan(input_name, tuple(columns), stacked)


def stack(chunk, plan: ColumnPlan, dtype: str, where: str) -> tuple[pa.Array, tuple[int, ...]]:
    """The plan's columns of ``chunk`` (Arrow table or dict of numpy arrays) as one canonical input column.

    Returns:
        (canonical Arrow array, row shape): ``[k]`` for ``k`` stacked scalar columns.

    Raises:
        DataError: a stacked column holds lists instead of scalars, or a value does not fit ``dtype``.
    """
    values = []
    for column in plan.columns:
        if isinstance(chunk, dict):
            arr, row_shape = numpy_to_canonical(chunk[column], column, plan.input_name, dtype, where)
        else:
            arr, row_shape = arrow_to_canonical(chunk.column(column), column, plan.input_name, dtype, where)
        if not plan.stacked:
            return arr, row_shape
        if row_shape:
            raise DataError(
                f"column '{column}' ({where}) holds rows of shape {list(row_shape)}, but data.columns."
                f"{plan.input_name} stacks several columns, which must each hold one value per row"
            )
        values.append(arr.to_numpy(zero_copy_only=False))
    matrix = np.stack(values, axis=1)  # [rows, k], C order: a row is the columns in the plan's order
    flat = pa.array(matrix.reshape(-1), type=pa.from_numpy_dtype(matrix.dtype))
    return pa.FixedSizeListArray.from_arrays(flat, len(plan.columns)), (len(plan.columns),)
