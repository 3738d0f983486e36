"""One preparation pipeline for every graph the engine sees: configure runs the same ordered passes on the whole model,
each pipeline stage, each tensor-parallel piece and each pipeline x tensor piece, and records them per graph."""

from __future__ import annotations

import json

import onnx
import pytest

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.examples.gpt import build_gpt
from ortflow.graph.prepare import PASSES

LAYOUTS = {"whole": (1, 1), "pipeline": (2, 1), "tensor": (1, 2), "pipeline x tensor": (2, 2)}


def _cfg(tmp_path, model_path, pp, hp):
    return config_from_dict({
        "name": "t", "output_dir": str(tmp_path / "run"),
        "model": {"path": str(model_path)},
        "data": {"train": str(tmp_path / "train.parquet")},
        "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"num_ranks": pp * hp, "pipeline_parallel_size": pp, "horizontal_parallel_size": hp},
    })


def _torch_style_gpt(path):
    """ortflow's GPT with LayerNormalization written as torch exports it (only ``Y``): the engine cannot build its
    gradient until the preparation passes declare the other outputs."""
    build_gpt(path, vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            del node.output[1:]
    onnx.save(model, str(path))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_graph_of_every_layout_goes_through_the_same_passes(tmp_path, layout):
    pp, hp = LAYOUTS[layout]
    path = tmp_path / "gpt.onnx"
    _torch_style_gpt(path)
    cfg = _cfg(tmp_path, path, pp, hp)
    configure(cfg)
    record = json.loads((cfg.output_dir / "configure.json").read_text())["graph_passes"]
    expected_graphs = {"whole": {"model"}, "pipeline": {"model", "stage-00", "stage-01"}}
    graphs = set(record)
    if layout in expected_graphs:
        assert graphs == expected_graphs[layout]
    elif layout == "tensor":
        assert "model" in graphs and {g.split("/")[0] for g in graphs - {"model"}} == {"rank-00", "rank-01"}
    else:
        assert {tuple(g.split("/")[:2]) for g in graphs - {"model"}} == {
            (f"stage-0{s}", f"rank-0{r}") for s in (0, 1) for r in (0, 1)}
    # A builder that hands the engine a graph without the pipeline records nothing (or a different list) for it.
    assert {name: passes for name, passes in record.items() if passes != list(PASSES)} == {}
    # And the graphs are what the passes make: every LayerNormalization the engine got declares all its outputs.
    built = list(cfg.artifacts_dir.rglob("training_model.onnx"))
    assert len(built) == len(record)
    for model_file in built:
        graph = onnx.load(str(model_file), load_external_data=False).graph
        norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
        assert all(len(n.output) == 3 for n in norms), model_file
