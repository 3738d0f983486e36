"""The committed real exports are what tools/export_fixtures.py records: exported by torch.onnx (TorchScript at opset
17, dynamo with its defaults), with the dynamic axes users give them."""

import onnx
import pytest

from tests.support.exports import (
    DYNAMO_NAMES,
    NAMES,
    PATTERN_NAMES,
    REFUSED_DYNAMO,
    VERSIONS,
    export_path,
    family,
    torch_record,
)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_the_recorded_export(name):
    model = onnx.load(str(export_path(name)))
    onnx.checker.check_model(model)
    assert model.producer_name == "pytorch"
    assert {o.domain: o.version for o in model.opset_import}[""] == VERSIONS["opset_torchscript"]
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param == "batch", f"{name}: the batch axis is not dynamic"


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_pattern_fixture_is_the_recorded_export_with_its_pattern(name):
    """Each holds the exporter's output that ortflow rewrites or refuses (tests/trainer/test_exporter_patterns.py
    trains them): the fixture keeps testing that pattern only while the pinned exporter still writes it."""
    path = export_path(name)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert model.producer_name == "pytorch"
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param, f"{name}: the batch axis is not dynamic"
    ops = [n.op_type for n in model.graph.node]
    if name == "gpt2-sdpa.onnx":  # TorchScript: each merged parameter read through Identity(kept) -> its torch name
        assert {o.domain: o.version for o in model.opset_import}[""] == VERSIONS["opset_torchscript"]
        params = set(torch_record("gpt2-sdpa")["parameters"])
        merged = {n.output[0] for n in model.graph.node if n.op_type == "Identity" and n.input[0] in params}
        assert len(merged) == 6 and merged <= params, merged
        assert not merged & {i.name for i in model.graph.initializer}
    else:  # dynamo: weights in external data
        assert path.with_name(path.name + ".data").exists()
    if name == "gpt2-sdpa-dynamo-noopt.onnx":
        assert ops.count("CastLike") == 6  # the attention's scale, cast like the query
    if name.startswith("bnmlp"):
        assert ops.count("BatchNormalization") == (1 if "noopt" in name else 0)  # folded into fc1's Gemm by default
        assert ops.count("Gemm") == 2


def test_gpt2_fixture_ties_embedding_and_lm_head():
    model = onnx.load(str(export_path("gpt2.onnx")))
    wte = "model.transformer.wte.weight"
    readers = [n.op_type for n in model.graph.node if wte in n.input]
    assert "Gather" in readers and len(readers) >= 2, readers
    assert not any(i.name.startswith("model.lm_head") for i in model.graph.initializer)


def test_no_two_fixture_parameters_share_values():
    # The exporter merges equal initializers into one tensor; the fixtures perturb every parameter so that none do.
    for name in NAMES:
        if name in ("llama.onnx", "llama-mqa.onnx"):
            continue  # RoPE's inv_freq is a buffer: the TorchScript export folds it into the graph.
        model = onnx.load(str(export_path(name)))
        seen = {}
        for init in model.graph.initializer:
            if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) >= 1:
                assert init.raw_data not in seen, f"{name}: {init.name} equals {seen.get(init.raw_data)}"
                seen[init.raw_data] = init.name


@pytest.mark.parametrize("name", DYNAMO_NAMES)
def test_dynamo_fixture_keeps_weights_in_external_data(name):
    path = export_path(name)
    model = onnx.load(str(path), load_external_data=False)
    assert model.ir_version == 10
    assert path.with_name(path.name + ".data").exists()
    external = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert external, f"{name}: the dynamo exporter wrote no external data"
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param, f"{name}: the batch axis is not dynamic"


@pytest.mark.parametrize("name", [*DYNAMO_NAMES, "gpt2-sdpa-dynamo-noopt.onnx", "bnmlp-dynamo.onnx",
                                  "bnmlp-dynamo-noopt.onnx"])
def test_dynamo_fixture_metadata_names_no_exporting_environment(name):
    """tools/export_fixtures.py drops the stack traces (paths, line numbers) and object addresses, which differ from
    one export to the next, and keeps the torch metadata configure reads on every node."""
    import re

    from ortflow.graph.exports.torch_params import CLASSES, FX_NODE, SCOPES

    model = onnx.load(str(export_path(name)), load_external_data=False)
    graph = model.graph
    for proto in (model, graph, *graph.node, *graph.input, *graph.output, *graph.value_info, *graph.initializer):
        for prop in proto.metadata_props:
            assert prop.key != "pkg.torch.onnx.stack_trace", f"{name}: a stack trace on {proto.name!r}"
            assert not re.search(r"0x[0-9a-f]{6,}|\.py\b", prop.value), f"{name}: {prop.key} = {prop.value[:200]!r}"
    exported = [n for n in graph.node if n.metadata_props]
    assert exported, f"{name}: no node metadata"
    assert all({FX_NODE, SCOPES, CLASSES} <= {p.key for p in n.metadata_props} for n in exported)


@pytest.mark.parametrize("name", [n for n in DYNAMO_NAMES if n.endswith("-dynamo-noopt.onnx")])
def test_noopt_dynamo_fixture_keeps_every_torch_parameter_name(name):
    model = onnx.load(str(export_path(name)), load_external_data=False)
    names = {i.name for i in model.graph.initializer}
    record = torch_record(family(name))
    # A tied parameter may be written under any of its torch names (GPT-2's table as model.lm_head.weight).
    aliases = {first: {first, other} for first, other in record["tied"]}
    missing = [p for p in record["parameters"] if not aliases.get(p, {p}) & names]
    assert not missing, missing


def _configure_fixture(root, name, **sections):
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure

    raw = {"name": name, "output_dir": str(root / name), "model": {"path": str(export_path(name))},
           "data": {"train": str(root / "unused.parquet")}, "train": {"batch_size": 2, "num_train_steps": 2},
           "optimizer": {"learning_rate": 1e-3}, **sections}
    return configure(config_from_dict(raw))


@pytest.mark.parametrize("name", DYNAMO_NAMES)
def test_dynamo_fixture_configures_with_its_torch_parameters_or_is_refused_before_training(tmp_path, name):
    from ortflow.config import ConfigError
    from ortflow.graph.exports.torch_params import NO_OPTIMIZE

    record = torch_record(family(name))
    if name in REFUSED_DYNAMO:  # dropped zero biases, folded BatchNorms, LSTM and GRU weights in the ops' layout
        with pytest.raises(ConfigError, match="has no tensor in the export|have no tensors of their own") as err:
            _configure_fixture(tmp_path, name)
        assert NO_OPTIMIZE in str(err.value)
        assert not (tmp_path / name / "artifacts").exists()  # refused before anything was built
        return
    info = _configure_fixture(tmp_path, name).info
    assert sorted(info["trainable"]) == sorted(record["parameters"])  # exactly the torch parameters, by torch name
    assert {k: v["shape"] for k, v in info["torch"]["parameters"].items()} == record["parameters"]
    frozen = info["torch"]["frozen"]
    assert not set(frozen) & set(info["trainable"])
    buffers = {n for n, why in frozen.items() if "buffer" in why}
    assert buffers <= set(info["frozen"])  # kept frozen; the constants the exporter computed are no initializers
    assert not (set(frozen) - buffers) & set(info["frozen"])
    assert set(record["buffers"]).isdisjoint(info["trainable"])


def test_state_dict_of_a_configured_run_is_the_fixture_state_dict(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file

    from ortflow.export.state_dict import export_state_dict
    from tests.support.exports import EXPORTS

    # dynamo, then TorchScript exports; BatchNorm's count 0 as torch's
    for name, state in (("llama-fresh-dynamo.onnx", "llama-fresh"), ("gpt2-dynamo.onnx", "gpt2"),
                        ("bnmlp-dynamo-noopt.onnx", "bnmlp"), ("cnn-dynamo-noopt.onnx", "cnn"),
                        ("rnn-dynamo-noopt.onnx", "rnn"), ("gpt2.onnx", "gpt2"), ("llama.onnx", "llama"),
                        ("cnn.onnx", "cnn"), ("rnn.onnx", "rnn"), ("qwen2-dynamo.onnx", "qwen2"),
                        ("llama-mqa-dynamo.onnx", "llama-mqa"), ("phi3.onnx", "phi3"), ("phi3-dynamo.onnx", "phi3"),
                        ("gemma-dynamo-noopt.onnx", "gemma"), ("gemma.onnx", "gemma"), ("neox.onnx", "neox"),
                        ("neox-dynamo.onnx", "neox"), ("neox-dynamo-noopt.onnx", "neox")):
        result = _configure_fixture(tmp_path, name)
        out = tmp_path / f"{state}.safetensors"
        export_state_dict(result.run_dir, out, checkpoint="initial")
        written, expected = load_file(str(out)), load_file(str(EXPORTS / f"{state}.safetensors"))
        assert sorted(written) == sorted(torch_record(family(name))["state_dict"])
        assert sorted(written) == sorted(expected)
        for key, value in expected.items():
            assert (written[key].dtype, written[key].shape) == (value.dtype, value.shape), key  # num_batches_tracked
            np.testing.assert_array_equal(written[key], value, err_msg=key)
        if state in ("bnmlp", "cnn", "rnn"):  # plain torch modules, exported without the Hugging Face wrapper
            continue
        stripped = tmp_path / f"{state}-hf.safetensors"
        export_state_dict(result.run_dir, stripped, checkpoint="initial", strip_prefix="model.")
        assert sorted(load_file(str(stripped))) == sorted(k.removeprefix("model.") for k in expected)


def _validate_fixture(tmp_path, name, **sections) -> list[str]:
    """``ortflow validate``'s problems with a run of the committed export on token rows."""
    import numpy as np
    import yaml

    from ortflow.validate import validate

    np.savez(tmp_path / "tokens.npz", input_ids=np.ones((64, 16), np.int64), labels=np.ones((64, 16), np.int64))
    raw = {"name": "v", "output_dir": str(tmp_path / "run"), "model": {"path": str(export_path(name))},
           "data": {"train": [str(tmp_path / "tokens.npz")]}, "train": {"batch_size": 2, "num_train_steps": 2},
           **sections}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    return validate(tmp_path / "run.yaml")


def test_gemma_default_dynamo_export_is_refused_by_validate_naming_the_folded_norm_weights(tmp_path):
    """The optimiser folded each RMSNorm's ``1 + weight`` into a constant: validate names the weights and the export
    call that keeps them (configure refuses it alike: REFUSED_DYNAMO)."""
    from ortflow.graph.exports.torch_params import NO_OPTIMIZE

    (problem,) = _validate_fixture(tmp_path, "gemma-dynamo.onnx")
    assert "'model.model.layers.0.input_layernorm.weight' has no tensor in the export" in problem, problem
    assert "folded it into the constant" in problem and NO_OPTIMIZE in problem


@pytest.mark.parametrize("name,tp", [("gemma.onnx", 1), ("gemma-dynamo-noopt.onnx", 2), ("gpt2.onnx", 1)])
def test_zero1_with_a_weight_tied_across_pipeline_stages_is_refused_by_validate_naming_the_weight_and_the_fix(
        tmp_path, name, tp):
    """The embedding tied to the LM head is read in the first and the last stage: ZeRO-1 over the stages' replicas
    would shard its gradients before the two stages add theirs, so validate refuses it (the ranks would), naming the
    weight and what to use instead; with one replica per stage, or the mean, the layout is accepted."""
    table = "model.transformer.wte.weight" if name.startswith("gpt2") else "model.model.embed_tokens.weight"
    layout = {"pipeline_parallel_size": 2, "horizontal_parallel_size": tp}
    (problem,) = _validate_fixture(tmp_path, name, distributed={"num_ranks": 4 * tp, "zero_stage": 1, **layout})
    assert problem.startswith("distributed.zero_stage 1 with pipeline stages that share a tied weight: "
                              f"'{table}' (stages 0, 1)"), problem
    assert "Use distributed.zero_stage 0" in problem and "pipeline_parallel_size 1" in problem
    assert _validate_fixture(tmp_path, name, distributed={"num_ranks": 4 * tp, "zero_stage": 0, **layout}) == []
    assert _validate_fixture(tmp_path, name, distributed={"num_ranks": 2 * tp, "zero_stage": 1, **layout}) == []


def test_constants_in_external_data_reach_the_passes_when_the_weights_stay_on_disk(tmp_path):
    from ortflow.config import config_from_dict
    from ortflow.configure.engine_input import prepare
    from ortflow.graph.exports.torch_params import torch_parameters

    model = torch_parameters(onnx.load(str(export_path("gpt2-dynamo.onnx")))).model
    path = tmp_path / "all-external.onnx"  # every tensor in external data, scalars and shapes too
    onnx.save(model, str(path), save_as_external_data=True, location="all-external.onnx.data", size_threshold=0)
    cfg = config_from_dict({"name": "x", "output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                            "data": {"train": str(tmp_path / "unused.parquet")},
                            "train": {"batch_size": 2, "num_train_steps": 2}})
    trainable = [t.name for t in model.graph.initializer if t.name.startswith("model.")]
    in_memory, _ = prepare(cfg, trainable, "logits", "labels", proto_limit=1 << 40)
    on_disk, batch = prepare(cfg, trainable, "logits", "labels", proto_limit=1)  # as a model over 2 GB is prepared
    assert batch is None  # the weights were not loaded
    assert on_disk.report == in_memory.report and in_memory.report


RELATIVE_LAYOUTS = {"dp": {}, "pp2": {"num_ranks": 2, "pipeline_parallel_size": 2},
                    "tp2": {"num_ranks": 2, "horizontal_parallel_size": 2}}


@pytest.mark.parametrize("layout", sorted(RELATIVE_LAYOUTS))
def test_a_python_config_with_relative_paths_configures_every_layout_from_the_current_folder(tmp_path, monkeypatch,
                                                                                              layout):
    """Relative paths of a config built in Python mean the current folder's files, in every layout: the split builders
    build in a scratch folder (their current folder), the ranks read the stored config from the run folder."""
    import shutil

    from ortflow.artifacts_folder import (
        ARTIFACT_FILES,
        piece_dir,
        read_stages_record,
        read_tensor_record,
        stage_dir,
    )
    from ortflow.config import config_from_dict, load_run_config
    from ortflow.configure.configure import configure

    name = "llama-dynamo.onnx"  # its weights in an external-data file beside it, read by a relative location too
    for file in (name, name + ".data"):
        shutil.copy(export_path(name).with_name(file), tmp_path / file)
    (tmp_path / "corpus.txt").write_text("a tiny corpus")
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict({
        "name": layout, "output_dir": "run",
        "model": {"path": name, "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": ["corpus.txt"], "format": "text", "text": {"seq_len": 8}},
        "train": {"batch_size": 2, "num_train_steps": 1},
        "distributed": RELATIVE_LAYOUTS[layout],
    })

    folder = configure(cfg).artifacts_dir
    assert folder == tmp_path / "run" / "artifacts"
    assert all((folder / f).exists() for f in ARTIFACT_FILES)
    if layout == "pp2":
        assert len(read_stages_record(folder)["stages"]) == 2
        for stage in range(2):
            assert all((stage_dir(folder, stage) / f).exists() for f in ARTIFACT_FILES), stage
    if layout == "tp2":
        pieces = len(read_tensor_record(folder)["pieces"])
        assert pieces > 1
        for rank in range(2):
            for piece in range(pieces):
                assert all((piece_dir(folder, rank, piece) / f).exists() for f in ARTIFACT_FILES), (rank, piece)
    monkeypatch.chdir(tmp_path / "run")  # the ranks, export and resume read the stored config from anywhere
    stored = load_run_config(tmp_path / "run")
    assert stored.output_dir == tmp_path / "run"
    assert stored.model.path == tmp_path / name
    assert stored.data.train == (str(tmp_path / "corpus.txt"),)
