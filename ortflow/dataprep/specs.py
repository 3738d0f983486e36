"""The training model's input specs (from configure.json) and the shape rule that maps sample rows to batches.

Shape rule: every input has a fixed per-row shape ``row_shape`` in the shards. A batch of ``B`` rows is stacked to
``[B, *row_shape]``. When the model declares exactly one dimension fewer than that (a GPT whose ``labels`` input is
``[N]`` with ``N = B*T`` while its rows are ``[T]``), the loader merges the two leading dims and feeds
``[B*row_shape[0], *row_shape[1:]]``. Any other rank difference is an error found at prepare time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortflow.config.sealed import RunFileDamaged, read_sealed
from ortflow.dataprep.errors import DataError

CONFIGURE_NAME = "configure.json"


@dataclass(frozen=True)
class InputSpec:
    """One training-model input: name, numpy dtype string and declared shape (ints or symbolic names)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


def read_train_inputs(output_dir: Path) -> list[InputSpec]:
    """Read the training model's inputs, in order, from ``<output_dir>/configure.json``.

    Raises:
        DataError: configure.json is missing or lacks a valid ``train_inputs`` list.
    """
    path = Path(output_dir) / CONFIGURE_NAME
    try:  # sealed by configure: a damaged record must not describe the data (ortflow/config/sealed.py)
        record = read_sealed(path, "re-run configure (`ortflow configure CONFIG`)")
    except RunFileDamaged as err:
        raise DataError(str(err)) from None
    if record is None:
        raise DataError(f"{path} does not exist: run configure first (`ortflow configure CONFIG`)")
    try:
        raw = record["train_inputs"]
        specs = [InputSpec(str(i["name"]), str(np.dtype(i["dtype"])), tuple(i["shape"])) for i in raw]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: no valid 'train_inputs' list ({err}); re-run configure") from None
    if not specs:
        raise DataError(f"{path}: 'train_inputs' is empty; re-run configure")
    return specs


def merges_leading_dims(
    spec: InputSpec, row_shape: tuple[int, ...], batch_size: int, column: str, is_label: bool = False
) -> bool:
    """Check that rows of ``row_shape`` batch into ``spec``'s shape; return whether leading dims are merged.

    Args:
        spec: the model input.
        row_shape: shape of one sample's value for this input.
        batch_size: rows per batch (checked against a fixed leading dim).
        column: the source column, named in errors.
        is_label: ``spec`` is the label the loss adds (not an input of the user's model): a fixed leading dim comes
            from the loss output, so from the model's batch dim.

    Raises:
        DataError: naming the column, when no batch of these rows has the model's rank and fixed dims.
    """
    declared = tuple(spec.shape)
    if len(declared) == len(row_shape) + 1:
        merge, batch_shape = False, (batch_size, *row_shape)
    elif len(declared) == len(row_shape) and row_shape:
        merge, batch_shape = True, (batch_size * row_shape[0], *row_shape[1:])
    else:
        raise DataError(
            f"column '{column}': rows have shape {list(row_shape)}, so batches are [B, *{list(row_shape)}], but model "
            f"input '{spec.name}' has {len(declared)} dims {list(declared)}; reshape the column so that each row has "
            f"{max(len(declared) - 1, 0)} dims (or {len(declared)} dims when the model merges batch and sequence)"
        )
    for axis, (want, got) in enumerate(zip(declared, batch_shape, strict=True)):
        if axis == 0 and isinstance(want, int) and want > 0 and want != got:
            rows = want // row_shape[0] if merge and row_shape[0] and want % row_shape[0] == 0 else want
            what = (f"the label '{spec.name}' that the loss adds, whose {want} values per batch follow the loss "
                    f"output and so the model's fixed batch dim of {rows}" if is_label else
                    f"model input '{spec.name}', which has a fixed batch dim of {want} that its graph depends on")
            axes = "{name: {0: 'batch'}} for each of its inputs" if is_label else f"{{'{spec.name}': {{0: 'batch'}}}}"
            raise DataError(
                f"column '{column}' feeds {what} (configure.json 'batch' says why it was kept), so every batch must "
                f"hold {rows} rows, not {batch_size}: set train.batch_size and train.eval_batch_size to {rows}, or "
                f"export the model with a dynamic batch dim (torch.onnx.export(..., dynamic_axes={axes}))"
            )
        if isinstance(want, int) and want > 0 and want != got:
            raise DataError(
                f"column '{column}': a batch would be {list(batch_shape)} but model input '{spec.name}' is fixed at "
                f"{list(declared)}; change the rows' shape or train.batch_size"
            )
    return merge
