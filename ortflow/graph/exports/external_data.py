"""Models past the protocol-buffer limit: the decision by size, and where their weights lie.

A serialised protobuf message cannot reach 2 GiB, so a model whose graph and weights together reach it keeps its
weights in external data files (ONNX's ``external_data`` entries: file, offset, length). Configure hands such a model
to the engine with its weights unread (:mod:`ortflow.configure.engine_input`), and export writes its inference model as
``model.onnx`` plus ``model.onnx.data`` (:mod:`ortflow.export.model`). Both take the limit as a parameter, so tests
take the large-model path on small models.
"""

from __future__ import annotations

from pathlib import Path

import onnx

#: Protocol buffers cannot serialise a message of 2 GiB or more.
PROTO_LIMIT = 2**31 - 1
#: Initializers smaller than this stay inside the model file when a model is written with external data.
INLINE_BYTES = 1024


def needs_external_data(proto_bytes: int, external_bytes: int, proto_limit: int = PROTO_LIMIT) -> bool:
    """Whether a model whose graph serialises to ``proto_bytes`` and whose weights outside it fill
    ``external_bytes`` must keep its weights in files: loaded into one proto it would reach ``proto_limit``."""
    return proto_bytes + external_bytes >= proto_limit


def proto_bytes(model: onnx.ModelProto) -> int:
    """The serialised size of ``model``, summed part by part: protobuf cannot size a whole message past 2 GiB
    (``ByteSize`` raises), but each tensor and node of a model is far below it. Exact up to each part's few bytes of
    field framing."""
    graph = model.graph
    parts = [*graph.initializer, *graph.node, *graph.input, *graph.output, *graph.value_info,
             *graph.sparse_initializer, *model.functions, *model.opset_import, *model.metadata_props]
    return sum(p.ByteSize() + 6 for p in parts) + 64


def external_files(model: onnx.ModelProto) -> list[str]:
    """The external data files the model's initializers name, relative to its folder, sorted."""
    return sorted({e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"})


def data_bytes(model_path: Path, model: onnx.ModelProto) -> int:
    """Bytes of the model's external data files (each file counted once)."""
    return sum((Path(model_path).parent / f).stat().st_size for f in external_files(model))


def save_with_external_data(model: onnx.ModelProto, path: Path, location: str) -> None:
    """Write ``model`` to ``path`` with every initializer of :data:`INLINE_BYTES` or more in ``location`` (a file
    name beside ``path``); each tensor's bytes leave the proto as they are written."""
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
              size_threshold=INLINE_BYTES)
