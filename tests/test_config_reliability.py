"""Inputs that used to end in a raw traceback or a silently wrong run: each gets a message naming the field and fix."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import ConfigError, find_problems, load_config
from tests.test_config import BASE, problems_of, tiny_model, write


def load_problems(path) -> list[str]:
    try:
        load_config(path)
    except ConfigError as err:
        return err.problems
    return []


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(BASE.encode() + b"# caf\xe9\n")
    assert load_problems(path) == [f"not UTF-8 text (byte 0xe9 at offset {len(BASE) + 5}); save the file as UTF-8"]


def test_deeply_nested_yaml_is_refused_without_recursion_error(tmp_path):
    path = write(tmp_path, "a: " + "[" * 5000 + "]" * 5000 + "\n")
    problems = load_problems(path)
    assert len(problems) == 1 and "nested too deeply" in problems[0]


@pytest.mark.parametrize("command", ["validate", "configure"])
def test_yaml_error_text_with_markup_is_printed_verbatim(tmp_path, command):
    path = write(tmp_path, "name: x\noutput_dir: [/tmp/x\nmodel: {path: m.onnx}\n")
    result = CliRunner().invoke(app, [command, str(path)])
    assert result.exit_code == 1, result.output
    assert "not valid YAML" in result.output and "[/tmp/x" in result.output  # rich did not eat it as markup
    assert "Traceback" not in result.output and "MarkupError" not in result.output


def test_rank_prefixes_survive_in_error_messages(tmp_path):
    path = write(tmp_path, 'name: "[rank 0] [/x]" extra\n')  # invalid YAML: the error quotes the line
    result = CliRunner().invoke(app, ["configure", str(path)])
    assert result.exit_code == 1
    assert '"[rank 0] [/x]" extra' in result.output and "Traceback" not in result.output


def test_an_unparsable_set_value_is_named(tmp_path):
    problems = problems_of(tmp_path, "train.batch_size=[8")
    assert len(problems) == 1 and problems[0].startswith("--set 'train.batch_size=[8': the value is not valid YAML")
    assert "quote it" in problems[0]


def test_a_set_list_of_patterns_gets_a_hint_to_quote_each_item_and_the_hinted_form_loads(tmp_path):
    """YAML reads a leading ``*`` as an alias. Quoting the whole list would make it one string; the hint quotes each
    item, and the exact ``--set`` it suggests loads the patterns as a list."""
    import shlex

    problems = problems_of(tmp_path, "tensorboard.histogram_names=[*.weight, h0.*]")
    assert len(problems) == 1 and "not valid YAML" in problems[0], problems
    hint = problems[0].partition("quote each item: ")[2]
    assert hint == """--set 'tensorboard.histogram_names=["*.weight", "h0.*"]'""", problems[0]
    option, value = shlex.split(hint)
    assert option == "--set"
    cfg = load_config(write(tmp_path), [value])
    assert cfg.tensorboard.histogram_names == ("*.weight", "h0.*")


def test_output_dir_that_is_a_file_is_named(tmp_path):
    tiny_model(tmp_path / "model.onnx")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "unit").write_text("a file")
    _, problems = find_problems(write(tmp_path))
    assert any(p.startswith("output_dir:") and "is a file, not a folder" in p for p in problems), problems


def _model_with_initializer(path, tensor):
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", tensor.name], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [tensor],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_nul_byte_in_an_external_data_path_is_named(tmp_path):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    weight.data_location = TensorProto.EXTERNAL
    del weight.float_data[:]
    weight.external_data.add(key="location", value="w\0.bin")
    _model_with_initializer(tmp_path / "model.onnx", weight)
    _, problems = find_problems(write(tmp_path))
    assert any("initializer 'w'" in p and "NUL byte" in p and "re-export" in p for p in problems), problems


def test_initializer_data_shorter_than_its_shape_names_the_tensor(tmp_path):
    weight = helper.make_tensor("dense.weight", TensorProto.FLOAT, [2], [1.0, 2.0], raw=False)
    weight = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight), "dense.weight")
    weight.raw_data = weight.raw_data[:4]  # one float instead of two
    _model_with_initializer(tmp_path / "model.onnx", weight)
    _, problems = find_problems(write(tmp_path))
    assert any("initializer 'dense.weight' declares shape [2] (8 bytes) but holds 4 bytes" in p for p in problems)


@pytest.mark.parametrize("field", ["train.seed", "train.batch_size", "distributed.threads_per_rank",
                                   "train.num_train_steps", "data.rows_per_shard"])
def test_absurd_sizes_are_refused_by_the_schema(tmp_path, field):
    problems = problems_of(tmp_path, f"{field}={10**30}")
    section, name = field.split(".")
    assert any(p.startswith(section) and name in p and "beyond any real run" in p for p in problems), problems


def test_a_boolean_is_not_a_batch_size(tmp_path):
    problems = problems_of(tmp_path, "train.batch_size=true")
    assert problems == ["train: batch_size is `true`, a boolean; give a number"]


def test_a_boolean_is_not_a_rank_count(tmp_path):
    # num_ranks takes a number or auto: `true` is a mistake, not one rank.
    assert problems_of(tmp_path, "distributed.num_ranks=true") == [
        "distributed: num_ranks is `true`, a boolean; give a number"]


@pytest.mark.parametrize("setting,problem", [
    ("distributed.recompute_forward=maybe", "distributed.recompute_forward: 'maybe' is not true, false or auto"),
    ("distributed.recompute_forward=AUTO", "distributed.recompute_forward: 'AUTO' is not true, false or auto"),
    ("distributed.recompute_forward=2", "distributed.recompute_forward: 2 is not true, false or auto"),
    ("distributed.num_ranks=many", "distributed.num_ranks: 'many' is not a positive number of ranks or auto"),
    ("distributed.num_ranks=0", "distributed.num_ranks: 0 is not a positive number of ranks or auto"),
])
def test_a_value_that_is_neither_auto_nor_the_other_kind_is_one_problem_naming_both(tmp_path, setting, problem):
    """A field taking a value or auto refuses anything else once, naming what it takes (not once per kind under
    pydantic's internal names, `recompute_forward.bool: ...`, `recompute_forward.literal['auto']: ...`)."""
    assert problems_of(tmp_path, setting) == [problem]


@pytest.mark.parametrize("written,read", [("auto", "auto"), ("true", True), ("yes", True), ("false", False),
                                          ("'false'", False), ("0", False)])
def test_recompute_forward_reads_yaml_booleans_as_every_boolean_field_does(tmp_path, written, read):
    cfg = load_config(write(tmp_path), [f"distributed.recompute_forward={written}"])
    assert cfg.distributed.recompute_forward == read


@pytest.mark.parametrize("setting", ["optimizer.learning_rate=.inf", "optimizer.weight_decay=.inf",
                                     "optimizer.learning_rate=.nan", "lr_schedule.min_lr_ratio=.nan",
                                     "optimizer.max_grad_norm=.inf", "optimizer.learning_rate=1e300"])
def test_non_finite_and_absurd_hyper_parameters_are_refused(tmp_path, setting):
    field = setting.split("=")[0]
    problems = problems_of(tmp_path, setting)
    assert len(problems) == 1 and problems[0].startswith(field + ":"), problems


def test_collective_timeout_must_be_at_least_a_second(tmp_path):
    problems = problems_of(tmp_path, "distributed.collective_timeout_s=1e-300")
    assert problems and problems[0].startswith("distributed.collective_timeout_s:") and "1" in problems[0]
    assert problems_of(tmp_path, "distributed.collective_timeout_s=1") == []


def test_a_misspelled_scalar_name_is_refused(tmp_path):
    problems = problems_of(tmp_path, "tensorboard.scalar_names=[train/loss, train/los]")
    assert len(problems) == 1 and "['train/los']" in problems[0] and "train/learning_rate" in problems[0]
    assert problems_of(tmp_path, "tensorboard.scalar_names=[train/loss]") == []


def test_ignore_index_belongs_to_cross_entropy(tmp_path):
    assert problems_of(tmp_path, "model.ignore_index=-100") == []
    problems = problems_of(tmp_path, "model.ignore_index=-100", "model.loss=mse")
    assert problems == ["model.ignore_index applies to cross_entropy only (model.loss is mse); remove it"]


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    path = write(tmp_path, BASE + "train: {batch_size: 8, num_train_steps: 12}\n")
    problems = load_problems(path)
    assert len(problems) == 1 and "'train' appears twice" in problems[0] and "lines 6 and 7" in problems[0]


def test_yaml_1_1_sexagesimal_numbers_are_text_not_numbers(tmp_path):
    path = write(tmp_path, BASE.replace("num_train_steps: 12", "num_train_steps: 1:30"))  # YAML 1.1: 90
    problems = load_problems(path)
    assert problems and any("train.num_train_steps" in p for p in problems)


def test_a_leading_zero_is_decimal_as_in_yaml_1_2(tmp_path):
    cfg = load_config(write(tmp_path, BASE.replace("num_train_steps: 12", "num_train_steps: 012")))
    assert cfg.train.num_train_steps == 12  # YAML 1.1 read 012 as octal 10


def test_a_set_override_follows_the_same_number_rules(tmp_path):
    cfg = load_config(write(tmp_path), ["train.num_train_steps=030"])
    assert cfg.train.num_train_steps == 30


def test_a_huge_config_is_refused_by_size_not_parsed(tmp_path):
    path = write(tmp_path, BASE + "# " + "x" * (2 << 20) + "\n")
    problems = load_problems(path)
    assert len(problems) == 1 and "bytes, more than a config can" in problems[0]


@pytest.mark.parametrize("device", ["/dev/zero", "fifo"])
def test_a_model_path_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, device):
    import os

    if device == "fifo":
        device = str(tmp_path / "model.fifo")
        os.mkfifo(device)
    cfg, problems = find_problems(write(tmp_path, BASE.replace("model.onnx", device)))
    assert cfg is not None and any("is not a regular file" in p and device in p for p in problems), problems


def test_warm_up_longer_than_the_run_is_refused(tmp_path):
    problems = problems_of(tmp_path, "lr_schedule.warmup_steps=4")  # 12 steps / 3 accumulation = 4 updates
    assert any("lr_schedule.warmup_steps 4" in p and "4 weight update" in p for p in problems), problems


def test_a_profile_that_ends_after_the_run_is_refused(tmp_path):
    # 4 weight updates: [5, 6] profiled nothing and [3, 6] fewer updates than asked, both without a word
    for steps in ("[5,6]", "[3,6]"):
        problems = problems_of(tmp_path, f"train.profile_steps={steps}")
        assert any(p.startswith(f"train.profile_steps {steps.replace(',', ', ')} ends after the run's 4 weight "
                                "update(s)") for p in problems), problems
    assert not problems_of(tmp_path, "train.profile_steps=[3,4]")


@pytest.mark.parametrize("field", ["init_from", "checkpoint_to_load_path"])
def test_a_missing_checkpoint_to_start_from_is_named_before_training(tmp_path, field):
    tiny_model(tmp_path / "model.onnx")
    cfg, problems = find_problems(write(tmp_path, BASE + f"checkpoint: {{{field}: nowhere/step-00000010}}\n"))
    assert any(f"checkpoint.{field}" in p and "does not exist" in p for p in problems), problems


def test_a_run_folder_given_as_a_config_is_refused_naming_its_own_config(tmp_path):
    # `ortflow retain RUN_DIR` (whose siblings train, evaluate and export take the run folder): the refusal names the
    # folder's config.yaml, which the command takes.
    (tmp_path / "config.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert "is not a regular file" in str(err.value), err.value
    assert f"a run folder's own config is {tmp_path / 'config.yaml'}" in str(err.value), err.value
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "none")  # another folder: no such hint
    assert "run folder" not in str(err.value), err.value
