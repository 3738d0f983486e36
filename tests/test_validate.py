"""``ortflow validate``: refused configs, the path checks, and every problem at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import DataError, prepare_data
from ortflow.validate import validate
from tests.support.batch_models import (
    batch_mean_classifier,
    classification_data,
    fixed_batch_classifier,
    reshape_batch_classifier,
    sequence_logits_model,
    undifferentiable_model,
)


def setup(tmp_path: Path, model_builder=fixed_batch_classifier, **changes) -> Path:
    """A valid classifier config (Parquet data) with ``changes`` merged into its sections; returns its path."""
    model_builder(path=tmp_path / "model.onnx")
    x, y = classification_data(40)
    pq.write_table(pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())), "labels": y}),
                   tmp_path / "train.parquet")  # fmt: skip
    raw = {
        "output_dir": "run", "model": {"path": "model.onnx"}, "data": {"train": "*.parquet"},
        "train": {"batch_size": 4, "num_train_steps": 2},
    }  # fmt: skip
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_valid_config_has_no_problems(tmp_path):
    result = CliRunner().invoke(app, ["validate", str(setup(tmp_path))])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_a_glob_that_matches_nothing(tmp_path):
    problems = validate(setup(tmp_path, data={"train": ["*.parquet", "missing/*.csv"]}))
    assert len(problems) == 1 and "data.train: '" in problems[0] and "missing/*.csv' matches no file" in problems[0]


def test_a_missing_column(tmp_path):
    problems = validate(setup(tmp_path, data={"columns": {"labels": "label"}}))
    assert any("no column 'label' for model input 'labels'" in p for p in problems), problems
    problems = validate(setup(tmp_path, data={"columns": {"features": "x*"}}))
    assert any("pattern 'x*' matches no column" in p for p in problems), problems


def test_a_batch_size_that_conflicts_with_a_fixed_batch_dim(tmp_path):
    # The Reshape constants hard-code batch 4: batch_size 8 cannot work, and the message gives the fix.
    problems = validate(setup(tmp_path, reshape_batch_classifier, train={"batch_size": 8}))
    assert problems and all("fixed batch dim of 4" in p and "set train.batch_size and train.eval_batch_size to 4"
                            in p for p in problems), problems  # fmt: skip
    problems = validate(setup(tmp_path, reshape_batch_classifier, train={"eval_batch_size": 3}))
    assert len(problems) == 2 and all("not 3" in p for p in problems)  # features and labels
    # The same fixed batch of 4 in a graph that does not use it becomes symbolic: batch_size 8 is fine.
    assert validate(setup(tmp_path, fixed_batch_classifier, train={"batch_size": 8})) == []


def test_prepare_data_reports_the_same_conflict_before_training(tmp_path):
    cfg = config_from_dict(yaml.safe_load(setup(tmp_path, reshape_batch_classifier).read_text()), base_dir=tmp_path)
    configure(cfg)
    bad = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": 8})})
    with pytest.raises(DataError, match="fixed batch dim of 4.*set train.batch_size and train.eval_batch_size to 4"):
        prepare_data(bad)
    assert not (cfg.data_dir / "manifest.json").exists()


def write_sequences(path: Path, label_rows) -> None:
    ids = np.random.default_rng(0).integers(0, 7, (12, 5))
    pq.write_table(pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int64())), "labels": label_rows(ids)}),
                   path)  # fmt: skip


def test_three_d_logits_with_cross_entropy_are_valid_when_labels_have_one_per_position(tmp_path):
    write_sequences(tmp_path / "seq.parquet", lambda ids: pa.array(list(ids), type=pa.list_(pa.int64())))
    path = setup(tmp_path, sequence_logits_model, data={"train": "seq.parquet"})
    assert validate(path) == []
    # One label per sequence does not fit [B, T, V] logits: the label rank is named.
    write_sequences(tmp_path / "seq.parquet", lambda ids: ids[:, 0])
    problems = validate(path)
    assert len(problems) == 1 and "column 'labels': rows have shape []" in problems[0]
    assert "model input 'labels' has 2 dims" in problems[0]


def test_a_model_the_engine_cannot_differentiate_shows_only_with_deep(tmp_path):
    path = setup(tmp_path, undifferentiable_model)
    assert validate(path) == []  # the graph itself is fine; only the gradient builder refuses it
    result = CliRunner().invoke(app, ["validate", str(path), "--deep"])
    assert result.exit_code == 1
    assert "1 problem(s)" in result.output
    assert "model.path:" in result.output and "Softplus" in result.output  # the engine names the op
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing was written into the run folder


def test_unwritable_output_and_export_paths(tmp_path):
    (tmp_path / "afile").write_text("")
    problems = validate(setup(tmp_path, output_dir="afile/run", export={"path": str(tmp_path)}))
    assert any(p.startswith("output_dir: cannot create") and "is a file" in p for p in problems), problems
    assert any(p.startswith("export.path:") and "is a folder" in p for p in problems), problems


def test_an_existing_tensorboard_folder_that_takes_no_files_is_a_problem(tmp_path):
    # /sys/kernel exists and passes the permission check for root, yet takes no new files: the first event file
    # failed in rank 0 with a traceback after validate had called the config valid
    problems = validate(setup(tmp_path, tensorboard={"log_dir": "/sys/kernel"}))
    assert any(p.startswith("tensorboard.log_dir: /sys/kernel ") and "choose another path" in p
               for p in problems), problems


def test_every_problem_at_once(tmp_path):
    path = setup(tmp_path, reshape_batch_classifier, data={"train": ["*.parquet", "none.csv"]},
                 train={"batch_size": 8}, export={"path": str(tmp_path)})  # fmt: skip
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 1
    assert "4 problem(s)" in result.output  # the glob, features and labels at batch 8, the export path
    assert "none.csv' matches no file" in result.output and "is a folder" in result.output


def test_tensor_parallelism_on_a_model_without_splittable_layers_is_a_problem(tmp_path):
    tp = {"num_ranks": 2, "horizontal_parallel_size": 2}
    # Gemm layers (torch's Linear on 2-D inputs) are split: fc1 by columns, fc2 by rows
    assert validate(setup(tmp_path / "gemm", distributed=tp)) == []
    # a batch mean between them is not followed: nothing to split, and validate says so before any engine call
    (problem,) = validate(setup(tmp_path / "mean", batch_mean_classifier, distributed=tp))
    assert "found no layer to split" in problem and "use 1" in problem


def test_tensor_parallelism_with_a_size_that_does_not_divide_the_heads_is_a_problem(tmp_path):
    from ortflow.examples.gpt import build_gpt

    path = setup(tmp_path, distributed={"num_ranks": 3, "horizontal_parallel_size": 3})
    build_gpt(tmp_path / "model.onnx", vocab_size=16, seq_len=4, d_model=8, num_layers=1, num_heads=2)
    problems = validate(path)
    assert any("horizontal_parallel_size 3 does not divide the 2 heads of h0.attn.q.weight" in p
               for p in problems), problems


def test_validate_refuses_too_few_training_rows_like_prepare_data(tmp_path):
    from tests.support.runs import build_mlp

    build_mlp(tmp_path / "mlp.onnx", num_features=8, hidden=4, num_classes=3, seed=0)
    rows = ["f0,f1,f2,f3,f4,f5,f6,f7,labels"] + [",".join(["0.5"] * 8) + f",{i % 3}" for i in range(40)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "c.yaml").write_text(
        "output_dir: run\nmodel: {path: mlp.onnx}\n"
        "data: {train: d.csv, columns: {features: 'f*'}, eval_fraction: 0.9}\n"
        "train: {batch_size: 8, num_train_steps: 4}\n"
    )
    problems = validate(tmp_path / "c.yaml")
    assert any("4 training row(s)" in p and "fewer than the 8" in p for p in problems), problems


def test_validate_accepts_a_feature_pattern_after_configure(tmp_path):
    from tests.support.runs import build_mlp

    build_mlp(tmp_path / "mlp.onnx", num_features=8, hidden=4, num_classes=3, seed=0)
    rows = ["f0,f1,f2,f3,f4,f5,f6,f7,labels"] + [",".join(["0.5"] * 8) + f",{i % 3}" for i in range(40)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{path: {tmp_path / 'mlp.onnx'}}}\n"
                      f"data: {{train: {tmp_path / 'd.csv'}, columns: {{features: 'f*'}}}}\n"
                      "train: {batch_size: 4, num_train_steps: 4}\n")
    assert CliRunner().invoke(app, ["configure", str(config)]).exit_code == 0
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0 and "valid" in result.output, result.output


def _pipeline_setup(tmp_path: Path, routed: bool, cut: str) -> Path:
    """A pp 2 config of the torch-shaped GPT (text data), cut at ``cut``; ``routed``: block 0's ArgMax is read after
    block 1, an int64 value of trained parameters that no cut between them can carry."""
    from tests.support.mlp_stack import B, T, build_torchlike

    tmp_path.mkdir(parents=True, exist_ok=True)
    build_torchlike(tmp_path / "model.onnx", routed=routed)
    (tmp_path / "train.txt").write_text("validate checks what configure builds. " * 200)
    raw = {"output_dir": "run", "model": {"path": "model.onnx", "pipeline_cuts": [cut]},
           "data": {"train": "train.txt", "format": "text", "text": {"seq_len": T}},
           "train": {"batch_size": B, "num_train_steps": 2},
           "distributed": {"num_ranks": 2, "pipeline_parallel_size": 2}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_pipeline_cut_configure_refuses_is_a_problem_with_and_without_deep(tmp_path):
    path = _pipeline_setup(tmp_path, routed=True, cut="blocks.0.resid")
    (problem,) = validate(path)
    assert "pipeline_parallel_size 2: cut 1 is crossed by non-float tensors" in problem
    assert "'blocks.0.top' (made by ArgMax" in problem and "move the cut" in problem
    result = CliRunner().invoke(app, ["validate", str(path), "--deep"])
    assert result.exit_code == 1 and "1 problem(s)" in result.output and "blocks.0.top" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing was written into the run folder


def test_deep_builds_the_pipeline_stages_configure_builds(tmp_path, caplog):
    path = _pipeline_setup(tmp_path, routed=False, cut="blocks.0.resid")
    with caplog.at_level("INFO"):
        assert validate(path, deep=True) == []
    assert "built 2 pipeline stages cut at ['blocks.0.resid']" in caplog.text  # the engine built each stage
    # A cut that is no tensor of the model: refused with the field, before and with the engine.
    bad = _pipeline_setup(tmp_path / "bad", routed=False, cut="no_such_tensor")
    (problem,) = validate(bad, deep=True)
    assert "model.pipeline_cuts: 'no_such_tensor' is not a tensor computed by the model" in problem
def _flat_model_setup(tmp_path: Path, **train) -> Path:
    """A GPT-style head traced at batch 4 whose logits are flattened to [4 * 2, V] by a hard-coded Reshape."""
    from tests.support.batch_models import flattened_logits_model

    flattened_logits_model(batch=4, seq=2, hard_coded=True, path=tmp_path / "flat.onnx")
    ids = np.random.default_rng(0).integers(0, 7, (40, 2))
    rows = pa.array(list(ids), type=pa.list_(pa.int64()))
    pq.write_table(pa.table({"input_ids": rows, "labels": rows}), tmp_path / "seq.parquet")
    path = tmp_path / "flat.yaml"
    path.write_text(yaml.safe_dump({"output_dir": "run", "model": {"path": "flat.onnx"},
                                    "data": {"train": "seq.parquet"},
                                    "train": {"num_train_steps": 2, **train}}))
    return path


def test_a_fixed_batch_gives_one_consistent_row_count_for_every_input(tmp_path):
    problems = validate(_flat_model_setup(tmp_path, batch_size=8))
    assert len(problems) == 2, problems
    assert all("every batch must hold 4 rows, not 8: set train.batch_size and train.eval_batch_size to 4" in p
               for p in problems), problems
    label = next(p for p in problems if "column 'labels'" in p)
    assert "the label 'labels' that the loss adds" in label and "dynamic_axes={'labels'" not in label


def test_a_global_batch_that_train_would_refuse_is_refused_before_training(tmp_path):
    path = _flat_model_setup(tmp_path, batch_size=4, global_batch_size=6)
    raw = yaml.safe_load(path.read_text())
    raw["distributed"] = {"num_ranks": 3}
    path.write_text(yaml.safe_dump(raw))
    problems = validate(path)
    # The message `ortflow train` gives for this layout (trainer/layout.py plan_batch).
    assert problems == ["train.global_batch_size 6 cannot be split over 3 rank(s) and the model's fixed batch dim 4: "
                        "use a global batch of 12, or no other rank(s)"]
    raw["train"]["global_batch_size"] = 12
    path.write_text(yaml.safe_dump(raw))
    assert validate(path) == []  # 3 ranks x the fixed batch 4: valid, the data checked at the ranks' batch 4
    raw["distributed"] = {"num_ranks": "auto"}
    raw["train"]["global_batch_size"] = 6
    path.write_text(yaml.safe_dump(raw))
    assert validate(path) == ["train.global_batch_size 6 is not a multiple of the model's fixed batch dim 4: use 4, 8"]


def test_optimizer_groups_are_checked_against_the_trained_parameters(tmp_path):
    problems = validate(setup(tmp_path, optimizer={"groups": [{"params": ["*bias"]}, {"params": ["fc1.bias", "x*"]}]}))
    assert len(problems) == 2, problems
    assert "optimizer.groups[1].params: 'fc1.bias' matches only parameters of optimizer.groups[0]" in problems[0]
    assert "optimizer.groups[1].params: 'x*' matches no trainable parameter" in problems[1]
    assert validate(setup(tmp_path, optimizer={"groups": [{"params": ["*bias"], "weight_decay": 0.0}]})) == []


def test_histogram_patterns_are_checked_against_the_trained_parameters(tmp_path):
    # a pattern that matches no trained parameter logged no histogram, without a word
    problems = validate(setup(tmp_path, tensorboard={"histogram_names": ["fc1.*", "encoder.*"]},
                              model={"path": "model.onnx", "frozen": ["fc2.bias"]}))
    assert problems == ["tensorboard.histogram_names: 'encoder.*' matches no trained parameter; fix the pattern "
                        "(parameters are named as in the ONNX model, e.g. 'fc1.bias', 'fc1.weight', 'fc2.weight')"]
    assert validate(setup(tmp_path, tensorboard={"histogram_names": ["fc2.bias"]}, model={
        "path": "model.onnx", "frozen": ["fc2.bias"]})) == ["tensorboard.histogram_names: 'fc2.bias' matches no "
        "trained parameter; fix the pattern (parameters are named as in the ONNX model, e.g. 'fc1.bias', "
        "'fc1.weight', 'fc2.weight')"]  # frozen parameters are no histograms


def test_layout_problems_split_the_global_batch_over_the_replicas_of_the_stages(tmp_path):
    from ortflow.dataprep.specs import InputSpec
    from ortflow.validate import layout_problems

    raw = yaml.safe_load(setup(tmp_path).read_text())
    raw["model"]["path"] = str(tmp_path / "model.onnx")
    raw["train"] = {"batch_size": 8, "num_train_steps": 2, "global_batch_size": 8}
    raw["distributed"] = {"num_ranks": 4, "pipeline_parallel_size": 2}
    specs = [InputSpec("features", "float32", (4, 8)), InputSpec("labels", "int64", (4,))]
    assert layout_problems(config_from_dict(raw), specs) == ([], 4)  # 2 replicas x the fixed batch 4
    raw["train"]["global_batch_size"] = 12
    problems, batch = layout_problems(config_from_dict(raw), specs)
    assert batch is None and problems == ["train.global_batch_size 12 cannot be split over 2 rank(s) and the model's "
                                          "fixed batch dim 4: use a global batch of 8 or 16, or 1 or 3 rank(s)"]


def _dynamo_config(tmp_path: Path, name: str, **distributed) -> Path:
    from tests.support.exports import export_path

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ortflow trains the models PyTorch exports. " * 400)
    raw = {"name": "d", "output_dir": str(tmp_path / "run"), "model": {"path": str(export_path(name))},
           "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": 16, "input_name": "input_ids"}},
           "train": {"batch_size": 2, "num_train_steps": 2},
           "distributed": {"num_ranks": distributed.get("pp", 1) * distributed.get("hp", 1),
                           "pipeline_parallel_size": distributed.get("pp", 1),
                           "horizontal_parallel_size": distributed.get("hp", 1)}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plain_validate_refuses_a_dynamo_export_whose_parameters_were_dropped_as_configure_does(tmp_path):
    problems = validate(_dynamo_config(tmp_path, "gpt2-fresh-dynamo.onnx"))
    assert any("has no tensor in the export" in p and "optimize=False" in p for p in problems), problems


def test_plain_validate_plans_the_stages_of_a_dynamo_export_on_its_torch_parameters(tmp_path):
    # hp 2: tests/test_validate_split_plan.py (the plan it prints)
    assert validate(_dynamo_config(tmp_path, "gpt2-dynamo.onnx", pp=2)) == []


def test_validate_deep_builds_a_default_dynamo_export(tmp_path):
    # The dynamo exporter keeps scalars and shapes as initializers: the passes read them, never a stripped value.
    assert validate(_dynamo_config(tmp_path, "llama-dynamo.onnx"), deep=True) == []


def test_a_checkpoint_that_training_would_refuse_for_its_split_is_a_problem_before_training(tmp_path):
    # The run folder's newest checkpoint was written by 2 pipeline stages; this config trains unsplit: the ranks would
    # refuse it at start, so validate says so first, with the same way out.
    from ortflow.checkpoints import CheckpointManager

    path = setup(tmp_path)
    folder = tmp_path / "run" / "checkpoints"

    def write(_, where):
        (where / "params-stage00-of-02.h5").write_bytes(b"weights")

    CheckpointManager(folder, 1, 5, is_writer=True, writer=write).save(
        3, None, {"global_cursor": 12, "pipeline_parallel_size": 2})
    refusals = [p for p in validate(path) if "pipeline_parallel_size 2 but this run has 1" in p]
    assert len(refusals) == 1 and str(folder / "step-00000003") in refusals[0], refusals
    assert f"checkpoint.init_from: {folder / 'step-00000003'} in a new run" in refusals[0], refusals
    assert not [p for p in validate(setup(tmp_path, distributed={"pipeline_parallel_size": 2, "num_ranks": 2}))
                if "was written with" in p]  # its own split resumes
    # A damaged checkpoint is skipped by training (an earlier one resumes, or none): not this refusal.
    (folder / "step-00000003" / "params-stage00-of-02.h5").write_bytes(b"flipped")
    assert not [p for p in validate(path) if "was written with" in p]


TOKENIZERS = Path(__file__).resolve().parent / "fixtures" / "tokenizers"


@pytest.mark.parametrize(("name", "table"), [("gpt2.onnx", "model.transformer.wte.weight"),
                                              ("gpt2-dynamo.onnx", "model.lm_head.weight"),
                                              ("llama.onnx", "model.model.embed_tokens.weight")])
def test_validate_refuses_a_tokenizer_with_more_ids_than_the_real_exports_embedding_has_rows(tmp_path, name, table):
    config = _dynamo_config(tmp_path, name)
    assert validate(config, [f"data.text.tokenizer={TOKENIZERS / 'bpe-512.json'}"]) == []
    problems = validate(config, [f"data.text.tokenizer={TOKENIZERS / 'bpe-1024.json'}"])
    assert problems == [
        f"data.text.tokenizer: {TOKENIZERS / 'bpe-1024.json'} has a vocabulary of 1024 (ids 0..1023), but the model's "
        f"input 'input_ids' indexes embedding table '{table}' of 512 rows, so ids 512..1023 would read past it; give "
        "the tokenizer the model was made for (its tokenizer.json), or export the model with an embedding of at least "
        "1024 rows (transformers: model.resize_token_embeddings(1024) before the export)"]


def test_validate_refuses_a_slow_tokenizers_files_naming_the_tokenizer_json_to_give(tmp_path):
    folder = tmp_path / "gpt2-tokenizer"
    folder.mkdir()
    (folder / "vocab.json").write_text('{"a": 0}')
    (folder / "merges.txt").write_text("#version: 0.2\n")
    config = _dynamo_config(tmp_path, "gpt2.onnx")
    result = CliRunner().invoke(app, ["validate", str(config), "--set", f"data.text.tokenizer={folder}"])
    assert result.exit_code == 1
    assert f"data.text.tokenizer: {folder} is a folder without a tokenizer.json" in " ".join(result.output.split())
    assert "save_pretrained(DIR)" in result.output and "Traceback" not in result.output
