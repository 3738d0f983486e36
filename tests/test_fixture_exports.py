"""The committed real exports are what tools/export_fixtures.py records: exported by torch.onnx, opset 17, with the
dynamic axes users give them."""

import onnx
import pytest

from tests.support.exports import NAMES, VERSIONS, export_path


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_the_recorded_export(name):
    model = onnx.load(str(export_path(name)))
    onnx.checker.check_model(model)
    assert model.producer_name == "pytorch"
    assert {o.domain: o.version for o in model.opset_import}[""] == VERSIONS["opset"]
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param == "batch", f"{name}: the batch axis is not dynamic"


def test_gpt2_fixture_ties_embedding_and_lm_head():
    model = onnx.load(str(export_path("gpt2.onnx")))
    wte = "model.transformer.wte.weight"
    readers = [n.op_type for n in model.graph.node if wte in n.input]
    assert "Gather" in readers and len(readers) >= 2, readers
    assert not any(i.name.startswith("model.lm_head") for i in model.graph.initializer)


def test_no_two_fixture_parameters_share_values():
    # The exporter merges equal initializers into one tensor; the fixtures perturb every parameter so that none do.
    for name in NAMES:
        model = onnx.load(str(export_path(name)))
        seen = {}
        for init in model.graph.initializer:
            if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) >= 1:
                assert init.raw_data not in seen, f"{name}: {init.name} equals {seen.get(init.raw_data)}"
                seen[init.raw_data] = init.name
