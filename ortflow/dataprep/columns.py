"""Conversion of source columns to the shards' canonical Arrow types, with dtype and shape checks.

In a shard, an input whose rows have shape ``row_shape`` is a ``fixed_size_list<dtype, prod(row_shape)>`` column
(a plain ``dtype`` column for scalar rows), flattened in C order, so the loader can view it as one numpy array.
``row_shape`` is kept in the field metadata and the manifest. Booleans are stored as uint8 (Arrow packs bools in bits,
which numpy cannot view).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ortflow.dataprep.errors import DataError

_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
# numpy kinds a source kind may be converted to (values are checked by the cast: floats feed integer inputs only when
# every value is a whole number in range, as CSV readers give labels written "1.0").
_ALLOWED = {"b": "biuf", "i": "iuf", "u": "iuf", "f": "fiu"}


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype stored in shards for a model dtype (bool is stored as uint8)."""
    dt = np.dtype(dtype)
    return np.dtype(np.uint8) if dt == np.bool_ else dt


def shard_field(name: str, dtype: str, row_shape: tuple[int, ...]) -> pa.Field:
    """The Arrow field of one input in a shard."""
    value_type = pa.from_numpy_dtype(storage_dtype(dtype))
    typ = pa.list_(value_type, math.prod(row_shape)) if row_shape else value_type
    return pa.field(name, typ, nullable=False, metadata={"row_shape": json.dumps(list(row_shape))})


def _check_kind(src: np.dtype | pa.DataType, dtype: str, column: str, input_name: str, where: str) -> None:
    try:
        src_np = np.dtype(src.to_pandas_dtype()) if isinstance(src, pa.DataType) else np.dtype(src)
    except (NotImplementedError, TypeError):
        src_np = None
    if src_np is None or dtype_kind(dtype) not in _ALLOWED.get(src_np.kind, ""):
        raise DataError(
            f"column '{column}' ({where}) holds {src}, but model input '{input_name}' is {dtype}; convert the column "
            f"to a numeric type that fits {dtype}"
        )


def dtype_kind(dtype: str) -> str:
    """numpy kind letter of a dtype string."""
    return np.dtype(dtype).kind


def arrow_to_canonical(arr: pa.Array | pa.ChunkedArray, column: str, input_name: str, dtype: str, where: str):
    """Convert one source column to (canonical Arrow array, row_shape).

    Raises:
        DataError: naming the column, for nulls, ragged lists or a dtype that cannot feed the input.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        raise DataError(f"column '{column}' ({where}) has {arr.null_count} null value(s); fill or drop them")
    n_rows, dims, flat = len(arr), [], arr
    while any(test(flat.type) for test in _LIST_TYPES):
        if pa.types.is_fixed_size_list(flat.type):
            size = flat.type.list_size
        else:
            lengths = pc.list_value_length(flat).to_numpy(zero_copy_only=False)
            size = int(lengths[0]) if len(lengths) else 0
            if len(lengths) and (lengths != size).any():
                raise DataError(
                    f"column '{column}' ({where}) has lists of different lengths ({lengths.min()}..{lengths.max()}); "
                    f"every row of an input needs the same shape: pad or cut them to one length"
                )
        flat = flat.flatten()
        if flat.null_count:
            raise DataError(f"column '{column}' ({where}) has null values inside its lists; fill or drop them")
        dims.append(size)
    _check_kind(flat.type, dtype, column, input_name, where)
    flat = _cast(flat, dtype, column, where)
    return _wrap(flat, tuple(dims), n_rows), tuple(dims)


def numpy_to_canonical(values: np.ndarray, column: str, input_name: str, dtype: str, where: str):
    """Convert a numpy array of shape [rows, *row_shape] to (canonical Arrow array, row_shape)."""
    if values.ndim == 0:
        raise DataError(f"column '{column}' ({where}) is a scalar, not an array of rows")
    _check_kind(values.dtype, dtype, column, input_name, where)
    flat = _cast(pa.array(np.ascontiguousarray(values).reshape(-1)), dtype, column, where)
    return _wrap(flat, tuple(values.shape[1:]), values.shape[0]), tuple(values.shape[1:])


#: The largest integer each float type holds exactly (its significand's bits + 1).
_EXACT_INTEGERS = {"float16": 2**11, "float32": 2**24, "float64": 2**53}


def _cast(flat: pa.Array, dtype: str, column: str, where: str) -> pa.Array:
    target = pa.from_numpy_dtype(storage_dtype(dtype))
    exact = _EXACT_INTEGERS.get(np.dtype(dtype).name)
    if exact is not None and pa.types.is_integer(flat.type) and len(flat):
        biggest = pc.max(pc.abs_checked(pc.cast(flat, pa.float64()))).as_py() or 0
        if biggest > exact:
            power = exact.bit_length() - 1
            raise DataError(
                f"column '{column}' ({where}) holds integers up to {int(biggest)}, but the model input is {dtype}, "
                f"which holds integers exactly only up to 2^{power}; rescale the column in the source or make the "
                f"model input an integer type"
            )
    if pa.types.is_boolean(flat.type) and dtype_kind(dtype) != "b":
        flat = pc.cast(flat, pa.uint8())
    try:
        return pc.cast(flat, target, safe=not pa.types.is_floating(target))
    except pa.ArrowInvalid as err:
        raise DataError(
            f"column '{column}' ({where}) does not fit the model input's {dtype} without losing information ({err}); "
            f"fix the values in the source (class labels must be whole numbers)"
        ) from None


def _wrap(flat: pa.Array, dims: tuple[int, ...], n_rows: int) -> pa.Array:
    if not dims:
        return flat
    arr = pa.FixedSizeListArray.from_arrays(flat, math.prod(dims))
    if len(arr) != n_rows:  # a zero-size row shape cannot tell the row count
        raise DataError(f"rows of shape {list(dims)} hold no values; every row needs at least one value")
    return arr
