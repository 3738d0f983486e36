"""An edit that the checkpoint to resume cannot feed (another optimizer wrote its state, or another pipeline or
tensor-parallel split wrote it) is refused before anything records it: ``ortflow configure``, the train stage and
``ortflow train --accept-changed-config`` leave the run folder's config.yaml, its record and its artifacts as they were,
so a later command reads the optimizer and layout the checkpoints were trained with; ``ortflow validate`` reports it.
Each names ``checkpoint.init_from``, as the ranks do."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import OptimizerConfig, load_run_config, write_resolved_config
from ortflow.config.sealed import verify_config
from tests.support.runs import make_run
from tests.test_checkpoints_h5 import save, trained

INIT_FROM = "with checkpoint.init_from: "


@pytest.fixture()
def sgd_run(tmp_path):
    """An MLP run folder configured with sgd whose newest checkpoint holds sgd's (empty) optimizer state."""
    cfg = make_run(tmp_path, "run", optimizer={"name": "sgd"})
    save(cfg.checkpoints_dir, trained(1, OptimizerConfig(name="sgd")), step=4, optimizer="sgd")
    return cfg


def _optimizer_recorded(cfg) -> str:
    verify_config(cfg.output_dir)  # the record still vouches for config.yaml
    return load_run_config(cfg.output_dir).optimizer.name


def test_configure_refuses_an_optimizer_the_checkpoint_cannot_feed_and_records_nothing(sgd_run, tmp_path):
    before = (sgd_run.output_dir / "config.yaml").read_bytes()
    config = tmp_path / "adamw.yaml"
    config.write_text(yaml.safe_dump({**sgd_run.model_dump(mode="json"), "optimizer": {"name": "adamw"}}))
    result = CliRunner().invoke(app, ["configure", str(config)])
    assert result.exit_code == 1, result.output
    assert "but optimizer adamw/torch needs ['exp_avg', 'exp_avg_sq']" in result.output, result.output
    assert INIT_FROM in result.output and "Traceback" not in result.output
    assert (sgd_run.output_dir / "config.yaml").read_bytes() == before
    assert _optimizer_recorded(sgd_run) == "sgd"


def test_configure_refuses_another_split_before_it_records_or_rebuilds_anything(sgd_run, tmp_path):
    from ortflow.artifacts_folder import verify_artifacts
    from ortflow.configure.configure import fingerprint, read_configure_record

    files = ("config.yaml", "configure.json")
    before = {name: (sgd_run.output_dir / name).read_bytes() for name in files}
    config = tmp_path / "pp2.yaml"
    config.write_text(yaml.safe_dump({**sgd_run.model_dump(mode="json"),
                                      "distributed": {"num_ranks": 2, "pipeline_parallel_size": 2}}))
    result = CliRunner().invoke(app, ["configure", str(config)])
    assert result.exit_code == 1, result.output
    assert "was written with distributed.pipeline_parallel_size 1 but this run has 2" in result.output, result.output
    assert INIT_FROM in result.output and "Traceback" not in result.output
    assert {name: (sgd_run.output_dir / name).read_bytes() for name in files} == before
    assert load_run_config(sgd_run.output_dir).distributed.pipeline_parallel_size == 1
    # The artifacts are still the unsplit ones the record vouches for: `ortflow train` resumes the folder as it was.
    record = read_configure_record(sgd_run.output_dir)
    assert record["fingerprint"] == fingerprint(sgd_run) and record["pipeline_cuts"] == []
    verify_artifacts(sgd_run.artifacts_dir, record)


def test_validate_reports_an_optimizer_the_checkpoint_cannot_feed(sgd_run, tmp_path):
    from ortflow.validate import validate

    before = (sgd_run.output_dir / "config.yaml").read_bytes()
    for name in ("sgd", "adamw"):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**sgd_run.model_dump(mode="json"), "optimizer": {"name": name}}))
        refused = [p for p in validate(config) if "holds optimizer state" in p]
        if name == "sgd":  # the optimizer that wrote the state resumes it
            assert refused == [], refused
        else:
            assert len(refused) == 1 and "but optimizer adamw/torch needs ['exp_avg', 'exp_avg_sq']" in refused[0]
            assert refused[0].startswith("checkpoint: ") and INIT_FROM in refused[0], refused
    assert (sgd_run.output_dir / "config.yaml").read_bytes() == before


def test_the_check_asks_for_the_state_the_configs_optimizer_keeps(sgd_run):
    from ortflow.checkpoints.layout_check import resume_layout_refusal

    assert resume_layout_refusal(sgd_run) is None  # the optimizer that wrote it resumes it
    momentum = sgd_run.model_copy(update={"optimizer": OptimizerConfig(name="sgd", momentum=0.9)})
    assert "needs ['momentum']" in resume_layout_refusal(momentum)


def test_the_configs_state_names_are_the_trainers_rules(tmp_path):
    """What the check asks for is what each rule of the trainer keeps."""
    import numpy as np

    from ortflow.trainer.optim import build_update, whole_segments

    segs = whole_segments(["w"], [4])
    for opt in (OptimizerConfig(name="adamw"), OptimizerConfig(name="lamb"), OptimizerConfig(name="sgd"),
                OptimizerConfig(name="sgd", momentum=0.9)):
        update = build_update(opt, segs, [np.zeros(4, np.float32)])
        assert tuple(update.rule.state_names) == opt.state_names, opt.name


def test_the_train_stage_refuses_the_edit_before_it_writes_the_config_for_the_ranks(sgd_run):
    from ortflow.tasks.training import TrainingFailed, train

    edited = sgd_run.model_copy(update={"optimizer": OptimizerConfig(name="adamw")})
    with pytest.raises(TrainingFailed, match="needs \\['exp_avg', 'exp_avg_sq'\\]") as err:
        train.fn(edited)
    assert err.value.will_repeat and INIT_FROM in str(err.value)
    assert _optimizer_recorded(sgd_run) == "sgd"


def test_the_train_stage_refuses_another_split_before_it_writes_the_config_for_the_ranks(sgd_run):
    from ortflow.config import DistributedConfig
    from ortflow.tasks.training import TrainingFailed, train

    split = DistributedConfig(num_ranks=2, pipeline_parallel_size=2)
    with pytest.raises(TrainingFailed, match="pipeline_parallel_size 1 but this run has 2") as err:
        train.fn(sgd_run.model_copy(update={"distributed": split}))
    assert err.value.will_repeat and INIT_FROM in str(err.value)
    verify_config(sgd_run.output_dir)
    assert load_run_config(sgd_run.output_dir).distributed.pipeline_parallel_size == 1


def test_an_accepted_hand_edit_that_the_checkpoint_cannot_feed_is_refused_and_stays_unaccepted(sgd_run):
    path = sgd_run.output_dir / "config.yaml"
    edited = path.read_text().replace("  name: sgd\n", "  name: adamw\n", 1)
    assert edited != path.read_text()
    path.write_text(edited)
    refused = CliRunner().invoke(app, ["train", str(sgd_run.output_dir), "--accept-changed-config"])
    assert refused.exit_code == 1 and INIT_FROM in refused.output, refused.output
    later = CliRunner().invoke(app, ["train", str(sgd_run.output_dir)])  # the edit was not recorded as accepted
    assert later.exit_code == 1 and "differs from what configure wrote" in later.output, later.output
    write_resolved_config(sgd_run)  # restored: the folder's record vouches for the sgd config again
    assert _optimizer_recorded(sgd_run) == "sgd"
