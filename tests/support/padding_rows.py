"""Torch's ``padding_idx`` on the committed dynamo exports of Gemma (row 0, its table tied to the LM head) and BERT
(row 0, untied): batches holding the padding id, and the reference that trains as torch's rule does, for the CPU
(tests/trainer/test_padding_rows_mpi.py) and GPU (tests/gpu/test_gpu_padding_rows.py) tests.

The reference is torch's rule written into the graph: the same export with the padding positions reading a frozen
copy of the table (``Where(ids == 0, Gather(copy, ids), Gather(table, ids))``: the same values, and the lookup's
gradient reaches the table from the other positions only, a tied LM head's in full), its Gather's torch record
without ``padding_idx`` so configure's masking does not apply to it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.exports.torch_params import FX_NODE
from tests.support.exports import EXPORTS, export_path

PAD = 0
#: The exports with torch's padding_idx 0, by family: Gemma's table is tied to its LM head, BERT's is not.
EXPORTS_BY_FAMILY = {"gemma": "gemma-dynamo-noopt.onnx", "bert": "bert-dynamo.onnx"}
TABLES = {"gemma": "model.model.embed_tokens.weight", "bert": "model.bert.embeddings.word_embeddings.weight"}


def gemma_batch(root):
    """Gemma's torch batch (8 rows of 16 tokens) with the padding id at the ends of the rows and once inside one."""
    from safetensors.numpy import load_file

    batch = load_file(str(EXPORTS / "gemma.grads.safetensors"))
    ids = batch["input.input_ids"].copy()
    ids[:, -3:] = PAD
    ids[0, 2] = PAD
    path = root / "gemma.npz"
    np.savez(path, input_ids=ids, labels=batch["labels"])
    return path


def bert_batch(root):
    """8 rows of 16 tokens for the BERT classifier: the padding id at attended positions (their gradient reaches the
    table) and at the masked ends of some rows."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 512, (8, 16))
    ids[:, 3] = PAD
    mask = np.ones_like(ids)
    mask[:4, -4:] = 0
    ids[:4, -4:] = PAD
    path = root / "bert.npz"
    np.savez(path, input_ids=ids, attention_mask=mask, labels=rng.integers(0, 3, 8))
    return path


def frozen_copy_model(root, export):
    """The export with the padding positions' lookup reading a frozen copy of the table (this module's docstring)."""
    model = onnx.load(str(export_path(export)))
    graph = model.graph
    (lookup,) = [n for n in graph.node if n.op_type == "Gather" and any(
        p.key == FX_NODE and "aten.embedding" in p.value and f", {PAD}), kwargs" in p.value for p in n.metadata_props)]
    for prop in lookup.metadata_props:  # torch's record without padding_idx (-1): configure does not mask it
        if prop.key == FX_NODE:
            prop.value = prop.value.replace(f", {PAD}), kwargs", ", -1), kwargs")
    table = next(t for t in graph.initializer if t.name == lookup.input[0])  # the export's name of the table
    graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(table), "padding_copy"))
    y, ids = lookup.output[0], lookup.input[1]
    lookup.output[0] = "trained_rows"
    consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.asarray(v, np.int64), n))
              for n, v in (("pad_id", PAD), ("pad_axes", [-1]))]
    added = [*consts, helper.make_node("Gather", ["padding_copy", ids], ["copied_rows"], axis=0),
             helper.make_node("Equal", [ids, "pad_id"], ["is_pad"]),
             helper.make_node("Unsqueeze", ["is_pad", "pad_axes"], ["is_pad_row"]),
             helper.make_node("Where", ["is_pad_row", "copied_rows", "trained_rows"], [y])]
    at = list(graph.node).index(lookup) + 1
    nodes = [*graph.node[:at], *added, *graph.node[at:]]
    del graph.node[:]
    graph.node.extend(nodes)
    path = root / export.replace("-dynamo", "-frozen-copy")
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path
