"""The GPU engine's half-precision kernel table: autocast keeps in fp32 what it has no kernel for, validate --deep
with device cuda reports what would stop the ranks."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.graph.exports.sequences import sequences_to_tensors
from ortflow.graph.precision.autocast import BFLOAT16, FLOAT16, autocast
from ortflow.graph.precision.cuda_kernels import element_types, has_kernel, missing_kernels, opsets, schema_admits
from ortflow.validate import validate
from tests.support.exports import DYNAMO_NAMES, NAMES, export_path
from tests.test_validate import setup


def test_the_table_knows_the_known_gaps():
    assert has_kernel("Pow", "", 15, BFLOAT16) is False  # the HF GPT-2 in bf16 stopped at rank start on this
    assert has_kernel("Pow", "", 15, FLOAT16) is True
    assert has_kernel("Add", "ai.onnx", 17, BFLOAT16) is True
    assert has_kernel("SkipLayerNormalization", "com.microsoft", 1, BFLOAT16) is False
    assert has_kernel("Pad", "", 19, BFLOAT16) is False  # a bf16 tensor-parallel LM head stopped at rank start on it
    assert has_kernel("Pad", "", 13, FLOAT16) is True
    assert has_kernel("NotAnOp", "", 17, BFLOAT16) is None  # not judged


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("compute", [FLOAT16, BFLOAT16], ids=["fp16", "bf16"])
def test_autocast_of_each_fixture_has_a_kernel_for_every_node(name, compute):
    model = autocast(onnx.load(str(export_path(name))), compute)
    assert missing_kernels(model) == []


# Every export, its sequence ops rewritten as configure rewrites them before autocast (the dynamo exports without
# optimisation write a split as SplitToSequence, which has no element type). ONNX Gelu (opset 20) is judged after
# preparation, which rewrites it into com.microsoft's (graph/exports/gelu.py).
AUTOCAST_FIXTURES = [*NAMES, *DYNAMO_NAMES]


@pytest.mark.parametrize("name", AUTOCAST_FIXTURES)
@pytest.mark.parametrize("compute", [FLOAT16, BFLOAT16], ids=["fp16", "bf16"])
def test_every_half_node_of_each_fixture_has_a_schema_type_and_a_judged_kernel(name, compute):
    model = autocast(sequences_to_tensors(onnx.load(str(export_path(name)))), compute)
    types, versions = element_types(model), opsets(model)
    refused, unjudged = [], set()
    for node in model.graph.node:
        half = {x for x in [*node.input, *node.output] if x and types.get(x) == compute}
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if not half or node.op_type in ("Cast", "Constant") or (node.op_type, versions[domain]) == ("Gelu", 20):
            continue
        if not schema_admits(node, versions[domain], compute, half):
            refused.append(f"{node.op_type} '{node.name}': no such type in its schema")
        judged = has_kernel(node.op_type, domain, versions[domain], compute)
        if judged is None:
            unjudged.add(node.op_type)
        elif not judged:
            refused.append(f"{node.op_type} '{node.name}': no CUDA kernel")
    assert not refused and not unjudged, (refused, unjudged)


def test_bf16_llama_keeps_rope_and_rmsnorm_math_in_fp32_and_says_why():
    for name in ("llama.onnx", "llama-dynamo.onnx"):
        model = autocast(onnx.load(str(export_path(name))), BFLOAT16)
        assert "Cos x1, Sin x1 for want of a bf16 type in the op's schema" in model.doc_string, model.doc_string
        assert "Neg x4" in model.doc_string and "Sqrt x5" in model.doc_string  # rotate_half; RMSNorm: no bf16 kernel
        fp16 = autocast(onnx.load(str(export_path(name))), FLOAT16)
        assert "for want of" not in fp16.doc_string  # fp16 has all of them: lowered
        matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
        types = element_types(model)
        assert all(types[n.output[0]] == BFLOAT16 for n in matmuls)  # the projections still run in bf16


def test_without_the_table_the_bf16_gpt2_would_need_a_missing_kernel():
    # The same check fails on the rewrite made without the table: the check above can fail.
    model = autocast(onnx.load(str(export_path("gpt2.onnx"))), BFLOAT16, check_kernels=False)
    missing = missing_kernels(model)
    assert missing and {m.op_type for m in missing} == {"Pow"}
    assert {m.opset for m in missing} == {17} and all(m.elem_type == BFLOAT16 for m in missing)
    cnn = autocast(onnx.load(str(export_path("cnn.onnx"))), BFLOAT16, check_kernels=False)
    # Conv stays fp32 even so: its schema has no bf16 type before opset 22 (the engine would refuse the graph)
    assert {m.op_type for m in missing_kernels(cnn)} == {"BatchNormalization"}
    assert "Conv x2 for want of a bf16 type in the op's schema" in cnn.doc_string


def test_autocast_keeps_the_recurrent_layers_fp32_and_says_why():
    """The engine trains an LSTM or GRU node as com.microsoft LSTMTraining/LSTMGrad (GRUTraining/GRUGrad), kernels of
    the CPU provider in float only: lowered to fp16 or bf16, the rank would find no kernel at all."""
    for compute in (FLOAT16, BFLOAT16):
        assert has_kernel("LSTM", "", 14, compute) is False and has_kernel("GRU", "", 14, compute) is False
        for name in ("rnn.onnx", "rnn-dynamo-noopt.onnx"):
            model = autocast(onnx.load(str(export_path(name))), compute)
            assert "GRU x1, LSTM x1 for want of a" in model.doc_string, model.doc_string
            types = element_types(model)
            recurrent = [n for n in model.graph.node if n.op_type in ("LSTM", "GRU")]
            assert len(recurrent) == 2 and all(types[x] == TensorProto.FLOAT for n in recurrent for x in n.input if x)
            assert any(types[n.output[0]] == compute for n in model.graph.node if n.op_type == "Gemm")  # the head


def test_bf16_autocast_keeps_pow_fp32_and_says_why():
    model = autocast(onnx.load(str(export_path("gpt2.onnx"))), BFLOAT16)
    assert "Pow x8 for want of a bf16 CUDA kernel" in model.doc_string
    fp16 = autocast(onnx.load(str(export_path("gpt2.onnx"))), FLOAT16)
    assert "for want of" not in fp16.doc_string  # fp16 has a Pow kernel: it is lowered


def _plant_bf16_pow(path):
    """The classifier with logits -> Cast(bf16) -> Pow(2) -> Cast(fp32) -> Add(logits): a node the GPU cannot run."""
    model = onnx.load(str(path))
    graph = model.graph
    graph.node[-1].output[0] = "pre"
    graph.node.extend([
        helper.make_node("Cast", ["pre"], ["pre_bf16"], to=TensorProto.BFLOAT16, name="/plant/Cast"),
        helper.make_node("Constant", [], ["two"], name="/plant/Two",
                         value=helper.make_tensor("two", TensorProto.BFLOAT16, [], [2.0])),
        helper.make_node("Pow", ["pre_bf16", "two"], ["sq_bf16"], name="/plant/Pow"),
        helper.make_node("Cast", ["sq_bf16"], ["sq"], to=TensorProto.FLOAT, name="/plant/Back"),
        helper.make_node("Add", ["pre", "sq"], ["logits"], name="/plant/Add"),
    ])  # fmt: skip
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def test_validate_deep_on_cuda_reports_a_planted_op_without_kernel(tmp_path):
    path = setup(tmp_path, distributed={"device": "cuda", "use_nccl": True})
    _plant_bf16_pow(tmp_path / "model.onnx")
    assert validate(path) == []  # only the built training graph shows it
    result = CliRunner().invoke(app, ["validate", str(path), "--deep"])
    assert result.exit_code == 1, result.output
    assert "Pow(17) node '/plant/Pow' runs in bfloat16" in result.output
    assert "Traceback" not in result.output
    on_cpu = setup(tmp_path / "cpu")
    _plant_bf16_pow(tmp_path / "cpu" / "model.onnx")
    assert not any("CUDA kernel" in p for p in validate(on_cpu, deep=True))  # a CPU run does not use the table


def test_validate_deep_on_cuda_checks_every_pipeline_stage_a_rank_loads(tmp_path):
    path = setup(tmp_path, distributed={"device": "cuda", "use_nccl": True, "num_ranks": 2,
                                        "pipeline_parallel_size": 2})
    _plant_bf16_pow(tmp_path / "model.onnx")
    problems = [p for p in validate(path, deep=True) if "'/plant/Pow' runs in bfloat16" in p]
    # The whole model's training graph (configure builds it too) and the last stage's hold the planted node, stage 0's
    # does not; the report names the stage.
    assert [p.split(":", 1)[0] for p in problems] == ["model.path", "model.path (in stages/stage-01)"], problems
