"""RunConfig: YAML loading, --set overrides, every validation rule, and the file checks."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    dump_config,
    find_problems,
    load_config,
    load_yaml,
    parse_overrides,
)

BASE = """
name: unit
output_dir: runs/unit
model: {path: model.onnx}
data: {train: "corpus/*.txt", format: text}
train: {batch_size: 4, num_train_steps: 12, gradient_accumulation_steps: 3}
"""


def write(tmp_path: Path, text: str = BASE, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(tmp_path: Path, *overrides: str) -> list[str]:
    try:
        load_config(write(tmp_path), list(overrides))
    except ConfigError as err:
        return err.problems
    return []


def tiny_model(path: Path, opset: int = 17, ir: int = 8) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    onnx.save(model, path)
    return path


# -- loading -----------------------------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    cfg = load_config(write(tmp_path))
    assert cfg.model.path == tmp_path / "model.onnx"
    assert cfg.output_dir == tmp_path / "runs/unit"
    assert cfg.data.train == (str(tmp_path / "corpus/*.txt"),)
    assert cfg.checkpoints_dir == tmp_path / "runs/unit/checkpoints"
    assert cfg.train.num_weight_updates == 4


def test_a_config_built_in_python_resolves_relative_paths_against_the_current_folder_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = {**load_yaml(BASE), "model": {"path": "model.onnx"},
           "data": {"train": ["corpus/*.txt"], "test": "test.txt", "format": "text", "text": {"tokenizer": "tok.json"}},
           "checkpoint": {"dir": "ckpt", "checkpoint_to_load_path": "ckpt/step", "init_from": "warm/step"},
           "tensorboard": {"log_dir": "tb"}, "export": {"path": "out/model.onnx"}, "distributed": {"hostfile": "hosts"}}
    for cfg in (config_from_dict(raw), RunConfig.model_validate(raw)):
        os.chdir("/")  # a later step's current folder (configure's scratch folders) changes nothing
        assert cfg.output_dir == tmp_path / "runs/unit"
        assert (cfg.model.path, cfg.data.text.tokenizer) == (tmp_path / "model.onnx", tmp_path / "tok.json")
        assert cfg.data.train == (str(tmp_path / "corpus/*.txt"),) and cfg.data.test == (str(tmp_path / "test.txt"),)
        assert (cfg.checkpoint.dir, cfg.checkpoint.checkpoint_to_load_path, cfg.checkpoint.init_from) == (
            tmp_path / "ckpt", tmp_path / "ckpt/step", tmp_path / "warm/step")
        assert (cfg.tensorboard.log_dir, cfg.export.path) == (tmp_path / "tb", tmp_path / "out/model.onnx")
        assert cfg.distributed.hostfile == tmp_path / "hosts"
        # The run folder's stored config names the same files, whichever folder reads it.
        stored = cfg.output_dir / "config.yaml"
        stored.parent.mkdir(parents=True, exist_ok=True)
        stored.write_text(dump_config(cfg))
        assert load_config(stored) == cfg
        monkeypatch.chdir(tmp_path)


def test_overrides_set_nested_values_with_yaml_types(tmp_path):
    cfg = load_config(write(tmp_path), ["train.batch_size=16", "optimizer.learning_rate=3e-4",
                                        "lr_schedule.name=cosine", "model.frozen=[emb.*, 'ln_*']"])
    assert cfg.train.batch_size == 16
    assert cfg.optimizer.learning_rate == pytest.approx(3e-4)
    assert cfg.lr_schedule.name == "cosine"
    assert cfg.model.frozen == ("emb.*", "ln_*")


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_overrides(["train.batch_size"])


def test_override_into_a_value_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="'name' is a value"):
        load_config(write(tmp_path), ["name.sub=1"])


def test_yaml_is_loaded_with_the_safe_loader(tmp_path):
    evil = BASE + "extra: !!python/object/apply:os.system ['echo hacked']\n"
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, evil))


def test_unknown_field_is_named(tmp_path):
    assert any("train.batchsize: unknown field" in p for p in problems_of(tmp_path, "train.batchsize=3"))


@pytest.mark.parametrize(("override", "named"), [
    ("optimizer.learnig_rate=0.1", "optimizer.learnig_rate: unknown field; did you mean optimizer.learning_rate?"),
    ("lr_scheduler.name=cosine", "lr_scheduler: unknown field; did you mean lr_schedule?"),
    ("optimizer.groups=[{params: ['*'], lr_scal: 2}]", "optimizer.groups.0.lr_scal: unknown field; did you mean "
     "optimizer.groups.0.lr_scale?"),
    ("train.warmup_steps=3", "train.warmup_steps: unknown field; did you mean lr_schedule.warmup_steps?"),
    # torch.optim's argument names, which docs/training.md compares the rules with
    ("optimizer.lr=0.1", "optimizer.lr: unknown field; did you mean optimizer.learning_rate?"),
    ("optimizer.betas=[0.9,0.95]", "optimizer.betas: unknown field; did you mean optimizer.beta1 and optimizer.beta2?"),
    ("optimizer.eps=1e-6", "optimizer.eps: unknown field; did you mean optimizer.epsilon?"),
])
def test_a_misspelled_field_is_named_with_the_field_meant(tmp_path, override, named):
    assert named in problems_of(tmp_path, override)


def test_missing_required_field_is_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"output_dir": "x", "model": {"path": "m.onnx"}, "data": {"train": "a"}})
    assert "train: required field is missing" in err.value.problems


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(write(tmp_path))
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg, tmp_path))  # paths inside the folder it is written to are relative to it
    assert load_config(again) == cfg


def test_the_resolved_config_stores_paths_inside_the_run_folder_relative_to_it(tmp_path):
    cfg = load_config(write(tmp_path))
    text = dump_config(cfg)
    assert "output_dir: ." in text and str(cfg.output_dir) not in text
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.yaml").write_text(text)
    assert load_config(moved / "config.yaml").output_dir == moved


def test_field_errors_are_all_reported_at_once(tmp_path):
    problems = problems_of(tmp_path, "train.batch_size=0", "optimizer.learning_rate=-1", "data.eval_fraction=2")
    assert len(problems) == 3
    assert {p.split(":")[0] for p in problems} == {"train.batch_size", "optimizer.learning_rate", "data.eval_fraction"}


# -- validation rules --------------------------------------------------------------------------------------------------


def test_parallel_sizes_must_multiply_to_the_world_size(tmp_path):
    (problem,) = problems_of(tmp_path, "distributed.num_ranks=4", "distributed.data_parallel_size=3")
    assert "= 3 must equal distributed.num_ranks (4): set num_ranks to 3, or leave data_parallel_size unset" in problem


def test_ranks_that_do_not_split_into_replicas_name_the_counts_that_do(tmp_path):
    # data_parallel_size left unset: the refusal names the ranks a replica takes and the counts that work, not a
    # derived data_parallel_size the user never wrote.
    (problem,) = problems_of(tmp_path, "distributed.num_ranks=3", "distributed.horizontal_parallel_size=2")
    assert problem == (
        "distributed.num_ranks 3 is not a multiple of horizontal_parallel_size (2) x pipeline_parallel_size (1) = 2, "
        "the ranks of one model replica: set num_ranks to a multiple of 2 (2, 4, 6, ...; data_parallel_size is "
        "num_ranks / 2), or change the parallel sizes")
    (problem,) = problems_of(tmp_path, "distributed.num_ranks=2", "distributed.horizontal_parallel_size=2",
                             "distributed.pipeline_parallel_size=2")
    assert "set num_ranks to a multiple of 4 (4, 8, 12, ...;" in problem and "data_parallel_size (" not in problem


def test_horizontal_parallelism_is_accepted_alone_and_with_data_parallel(tmp_path):
    assert problems_of(tmp_path, "distributed.num_ranks=2", "distributed.horizontal_parallel_size=2") == []
    assert problems_of(tmp_path, "distributed.num_ranks=4", "distributed.horizontal_parallel_size=2") == []
    assert problems_of(tmp_path, "distributed.num_ranks=8", "distributed.horizontal_parallel_size=2",
                       "distributed.pipeline_parallel_size=2") == []  # dp 2 x pp 2 x hp 2 on CPU ranks
    assert problems_of(tmp_path, "distributed.num_ranks=4", "distributed.horizontal_parallel_size=2",
                       "distributed.pipeline_parallel_size=2", "distributed.device=cuda",
                       "distributed.use_nccl=true") == []  # pp 2 x hp 2 on GPUs


@pytest.mark.parametrize("overrides,expected", [
    (("distributed.num_ranks=2", "precision.use_mixed_precision=true"), "needs distributed.device: cuda"),
    (("distributed.num_ranks=2", "distributed.device=cuda"), "set use_nccl true with device cuda"),
    (("distributed.num_ranks=2", "distributed.use_nccl=true"), "false with device cpu"),
])
def test_horizontal_parallelism_refuses_what_it_does_not_combine_with(tmp_path, overrides, expected):
    problems = problems_of(tmp_path, "distributed.horizontal_parallel_size=2", *overrides)
    assert any(expected in p for p in problems), problems


def test_pipeline_parallel_size_divides_the_ranks_into_replicas(tmp_path):
    assert problems_of(tmp_path, "distributed.num_ranks=4", "distributed.pipeline_parallel_size=2") == []
    (problem,) = problems_of(tmp_path, "distributed.num_ranks=4", "distributed.pipeline_parallel_size=3")
    assert problem.startswith(
        "distributed.num_ranks 4 is not a multiple of horizontal_parallel_size (1) x pipeline_parallel_size (3) = 3")


def test_pipeline_cuts_must_name_one_tensor_per_boundary(tmp_path):
    (problem,) = problems_of(tmp_path, "distributed.num_ranks=3", "distributed.pipeline_parallel_size=3",
                             "model.pipeline_cuts=[a]")
    assert problem.startswith("model.pipeline_cuts names 1 tensor(s) but distributed.pipeline_parallel_size 3 needs 2")


def test_num_train_steps_must_be_a_multiple_of_accumulation(tmp_path):
    (problem,) = problems_of(tmp_path, "train.num_train_steps=10")
    assert problem == (
        "train.num_train_steps (10) must be a multiple of train.gradient_accumulation_steps (3); use 9 or 12"
    )


def test_zero_stage_above_1_is_refused_and_stage_1_accepted_on_cpu(tmp_path):
    problems = problems_of(tmp_path, "distributed.zero_stage=2")
    assert any("zero_stage 2 is not supported; use 0 or 1" in p for p in problems)
    assert not problems_of(tmp_path, "distributed.zero_stage=1")


@pytest.mark.parametrize("layout,why", [
    ((), "an unsplit model trains in the engine's training call"),
    (("distributed.num_ranks=2", "distributed.pipeline_parallel_size=2", "distributed.recompute_forward=true"),
     "recompute_forward true runs every forward again"),
    (("distributed.num_ranks=2", "distributed.horizontal_parallel_size=2", "distributed.recompute_forward=true"),
     "recompute_forward true runs every forward again"),
])
def test_recompute_subgraphs_where_no_forward_keeps_its_activations_is_refused_with_why(tmp_path, layout, why):
    (problem,) = problems_of(tmp_path, *layout, "distributed.recompute_subgraphs=['Gelu+:1:-1']")
    assert problem.startswith("distributed.recompute_subgraphs ['Gelu+:1:-1'] would recompute nothing: " + why)
    assert "remove recompute_subgraphs" in problem


@pytest.mark.parametrize("layout", [("distributed.pipeline_parallel_size=2",),
                                    ("distributed.horizontal_parallel_size=2",),
                                    ("distributed.pipeline_parallel_size=2", "distributed.recompute_forward=false")])
def test_recompute_subgraphs_is_accepted_where_stages_or_pieces_keep_their_activations(tmp_path, layout):
    assert problems_of(tmp_path, "distributed.num_ranks=2", *layout,
                       "distributed.recompute_subgraphs=['Gelu+:1:-1']") == []


def test_mixed_precision_on_the_cpu_is_refused_with_why_and_what_instead(tmp_path):
    (problem,) = problems_of(tmp_path, "precision.use_mixed_precision=true")
    assert "needs distributed.device: cuda" in problem and "no fp16/bf16 training kernels" in problem
    assert "train in fp32 (use_mixed_precision: false)" in problem


def test_mixed_precision_on_cuda_is_accepted_and_loss_scale_rules(tmp_path):
    gpu = ["distributed.device=cuda", "distributed.use_nccl=true", "precision.use_mixed_precision=true"]
    assert problems_of(tmp_path, *gpu) == []
    assert any("loss_scale applies to fp16 only" in p
               for p in problems_of(tmp_path, *gpu, "precision.use_bfloat16=true", "precision.loss_scale=128"))
    assert any("export.precision compute needs" in p for p in problems_of(tmp_path, "export.precision=compute"))


def test_bfloat16_needs_mixed_precision(tmp_path):
    assert any("use_bfloat16 needs" in p for p in problems_of(tmp_path, "precision.use_bfloat16=true"))


def test_lamb_and_sgd_momentum_are_accepted_and_nesterov_needs_momentum(tmp_path):
    assert not problems_of(tmp_path, "optimizer.name=lamb")
    assert not problems_of(tmp_path, "optimizer.name=sgd", "optimizer.momentum=0.9", "optimizer.nesterov=true")
    (problem,) = problems_of(tmp_path, "optimizer.name=sgd", "optimizer.nesterov=true")
    assert "nesterov needs optimizer.momentum > 0" in problem


@pytest.mark.parametrize(("overrides", "named"), [
    (["optimizer.momentum=0.9"], "optimizer.momentum applies to sgd, not adamw"),
    (["optimizer.name=lamb", "optimizer.dampening=0.1"], "optimizer.dampening applies to sgd, not lamb"),
    (["optimizer.name=sgd", "optimizer.beta2=0.95"], "optimizer.beta2 applies to adamw and lamb, not sgd"),
    (["optimizer.name=sgd", "optimizer.epsilon=1e-6"], "optimizer.epsilon applies to adamw and lamb, not sgd"),
    (["optimizer.ratio_max=10"], "optimizer.ratio_max applies to lamb, not adamw"),
    (["optimizer.name=lamb", "optimizer.rule=engine"], "optimizer.rule applies to adamw, not lamb"),
])
def test_a_hyper_parameter_the_optimizer_does_not_use_is_refused_not_ignored(tmp_path, overrides, named):
    (problem,) = problems_of(tmp_path, *overrides)
    assert named in problem and "remove it" in problem, problem


@pytest.mark.parametrize(("overrides", "named"), [
    (["lr_schedule.min_lr_ratio=0.1"], "lr_schedule.min_lr_ratio applies to linear, cosine and polynomial, not "
     "constant"),
    (["lr_schedule.name=cosine", "lr_schedule.power=2"], "lr_schedule.power applies to polynomial, not cosine"),
])
def test_a_schedule_setting_the_schedule_does_not_use_is_refused_not_ignored(tmp_path, overrides, named):
    (problem,) = problems_of(tmp_path, *overrides)
    assert named in problem and "remove it" in problem, problem
    assert not problems_of(tmp_path, "lr_schedule.name=polynomial", "lr_schedule.power=2",
                           "lr_schedule.min_lr_ratio=0.1")


def test_the_defaults_of_other_optimizers_hyper_parameters_are_accepted(tmp_path):
    # the resolved config.yaml of a run folder writes every field, the other optimizers' at their defaults
    for name in ("adamw", "sgd", "lamb"):
        assert not problems_of(tmp_path, f"optimizer.name={name}", "optimizer.momentum=0.0", "optimizer.beta1=0.9",
                               "optimizer.epsilon=1e-8", "optimizer.rule=torch", "optimizer.ratio_min=0.0")


def test_adasum_needs_a_power_of_two_of_data_parallel_ranks(tmp_path):
    assert not problems_of(tmp_path, "distributed.enable_adasum=true", "distributed.num_ranks=4")
    (problem,) = problems_of(tmp_path, "distributed.enable_adasum=true", "distributed.num_ranks=3")
    assert "power-of-two" in problem and "use 2 or 4 ranks" in problem
    problems = problems_of(tmp_path, "distributed.enable_adasum=true", "distributed.num_ranks=2",
                           "distributed.zero_stage=1", "distributed.use_nccl=true")
    assert any("use zero_stage 0 with it" in p for p in problems)
    assert not problems_of(tmp_path, "distributed.enable_adasum=true", "distributed.num_ranks=4",
                           "distributed.device=cuda", "distributed.use_nccl=true")  # NCCL Adasum on GPU ranks


def test_model_output_loss_needs_the_output_name(tmp_path):
    assert any("model.loss_output" in p for p in problems_of(tmp_path, "model.loss=model_output"))


def test_multi_host_needs_a_hostfile(tmp_path):
    problems = problems_of(tmp_path, "distributed.num_hosts=2", "distributed.num_ranks=2")
    assert any("give distributed.hostfile" in p for p in problems)


def test_schedule_takes_cron_or_interval_not_both(tmp_path):
    problems = problems_of(tmp_path, "schedule.cron='0 3 * * *'", "schedule.interval_s=60")
    assert any("either cron or interval_s" in p for p in problems)


# -- file checks -------------------------------------------------------------------------------------------------------


def test_missing_model_file_is_named(tmp_path):
    _, problems = find_problems(write(tmp_path))
    assert problems == [f"model.path: {tmp_path / 'model.onnx'} does not exist; check the path (relative paths start "
                        "at the config's folder)"]


def test_not_an_onnx_file_is_refused(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"definitely not protobuf \x00\xff")
    _, problems = find_problems(write(tmp_path))
    assert len(problems) == 1 and "is not a valid ONNX model" in problems[0]


def test_opset_and_ir_too_new_are_refused_with_the_fix(tmp_path):
    tiny_model(tmp_path / "model.onnx", opset=22, ir=11)
    _, problems = find_problems(write(tmp_path))
    assert any("opset 22 is newer than the engine runs (<= 21)" in p and "opset_version=21" in p for p in problems)
    assert any("IR version 11 is newer than the engine runs (<= 10)" in p for p in problems)


def test_a_runnable_model_passes(tmp_path):
    tiny_model(tmp_path / "model.onnx")
    cfg, problems = find_problems(write(tmp_path))
    assert problems == [] and cfg is not None


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    tiny_model(model_dir / "model.onnx")
    proto = onnx.load(model_dir / "model.onnx")
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    weight.data_location = TensorProto.EXTERNAL
    del weight.float_data[:]
    weight.external_data.add(key="location", value="../secrets.bin")
    proto.graph.initializer.append(weight)
    onnx.save(proto, model_dir / "model.onnx")
    _, problems = find_problems(write(tmp_path, BASE.replace("model.onnx", "m/model.onnx")))
    assert any("outside the model's folder" in p and "'w'" in p for p in problems)


# -- CLI ---------------------------------------------------------------------------------------------------------------


def test_validate_prints_every_problem_and_exits_1(tmp_path):
    result = CliRunner().invoke(app, ["validate", str(write(tmp_path)), "--set", "optimizer.name=lamb", "--set",
                                      "optimizer.ratio_min=2", "--set", "optimizer.ratio_max=1", "--set",
                                      "train.num_train_steps=10"])  # fmt: skip
    assert result.exit_code == 1
    assert "2 problem(s)" in result.output
    assert "ratio_max (1.0) must be >= optimizer.ratio_min" in result.output and "multiple of" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_a_command_that_takes_a_run_folder_given_the_config_file_names_the_steps_and_the_run_folder(tmp_path, command):
    config = write(tmp_path)
    result = CliRunner().invoke(app, [command, str(config)])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert (f"{config} is a config file, not a run folder: run `ortflow configure {config}` and `ortflow prepare-data "
            f"{config}`, then give its run folder {tmp_path / 'runs' / 'unit'}") in said, said
    assert str(tmp_path / "runs" / "unit") in said and "Traceback" not in said, said
    if command == "train":  # once configured, the run folder alone
        (tmp_path / "runs" / "unit").mkdir(parents=True)
        (tmp_path / "runs" / "unit" / "config.yaml").write_text(BASE)
        said = " ".join(CliRunner().invoke(app, [command, str(config)]).output.split())
        assert f"{config} is a config file, not a run folder: give its run folder {tmp_path / 'runs' / 'unit'}" in said
        assert "ortflow configure" not in said, said


def test_a_command_that_takes_a_run_folder_given_another_file_says_it_is_no_run_folder(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("not a config: [")
    result = CliRunner().invoke(app, ["train", str(other)])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert f"{other} is a file, not a run folder" in said and "Traceback" not in said, said


def test_validate_accepts_a_good_config(tmp_path):
    from tests.support.batch_models import sequence_logits_model

    sequence_logits_model(seq=128, vocab=256, path=tmp_path / "model.onnx")  # input_ids [B, T] -> logits [B, T, V]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world " * 400)  # enough windows for one update of 12 rows
    result = CliRunner().invoke(app, ["validate", str(write(tmp_path))])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_help_lists_the_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("validate", "configure", "prepare-data", "train"):
        assert command in result.output


SPLITS = {"pp2": ("distributed.pipeline_parallel_size=2",), "tp2": ("distributed.horizontal_parallel_size=2",),
          "pp2tp2": ("distributed.pipeline_parallel_size=2", "distributed.horizontal_parallel_size=2")}


@pytest.mark.parametrize("split", ["pp2", "tp2"])
@pytest.mark.parametrize("setting", ["distributed.zero_stage=1", "distributed.enable_adasum=true"])
def test_gpu_split_models_refuse_sharded_or_adasum_exchanges_and_cpu_ranks_take_them(tmp_path, setting, split):
    gpu = ("distributed.device=cuda", "distributed.use_nccl=true")
    problems = problems_of(tmp_path, "distributed.num_ranks=4", *SPLITS[split], setting, *gpu)
    assert any("averages each stage's or slice's gradients over its replicas (ZeRO-0" in p for p in problems), problems
    assert problems_of(tmp_path, "distributed.num_ranks=4", *SPLITS[split], setting) == []


@pytest.mark.parametrize("precision", [("precision.use_mixed_precision=true",),
                                       ("precision.use_mixed_precision=true", "precision.use_bfloat16=true")])
def test_pipeline_stages_and_tensor_parallelism_take_mixed_precision_each_alone(tmp_path, precision):
    gpu = ("distributed.num_ranks=4", "distributed.device=cuda", "distributed.use_nccl=true", *precision)
    assert problems_of(tmp_path, *SPLITS["pp2"], *gpu) == []
    assert problems_of(tmp_path, *SPLITS["tp2"], *gpu) == []
    (problem,) = problems_of(tmp_path, *SPLITS["pp2tp2"], *gpu)
    assert "pipeline_parallel_size > 1 with horizontal_parallel_size > 1 trains in fp32" in problem, problem
    assert problem.endswith("or split the model one way"), problem


def test_max_eval_batches_is_refused_with_the_global_row_limit_as_the_fix():
    from ortflow.config import TrainConfig

    with pytest.raises(ValueError, match="use train.max_eval_rows"):
        TrainConfig(batch_size=2, num_train_steps=4, max_eval_batches=3)
    assert TrainConfig(batch_size=2, num_train_steps=4, max_eval_rows=3).max_eval_rows == 3


def test_profile_steps_work_in_every_cpu_layout_and_are_refused_by_name_on_gpus(tmp_path):
    for layout in ((), ("distributed.pipeline_parallel_size=2",), ("distributed.horizontal_parallel_size=2",)):
        assert problems_of(tmp_path, "distributed.num_ranks=2", "train.profile_steps=[1,2]", *layout) == []
    problems = problems_of(tmp_path, "distributed.device=cuda", "distributed.use_nccl=true",
                           "train.profile_steps=[1,2]")
    assert any(p.startswith("train.profile_steps traces CPU ranks only") for p in problems), problems
