"""A Hugging Face GPT-2 export trained on text tokenized with a tokenizers JSON file, as a user runs it: validate,
configure, prepare-data, train, evaluate, export and sample, each through the `ortflow` command but the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import load_run_config
from ortflow.dataprep import TrainLoader
from ortflow.dataprep.tokenizer import open_tokenizer
from ortflow.sample import generate
from tests.support.exports import export_path
from tests.support.runs import CORPUS, run_ranks

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers" / "bpe-512.json"
SEQ = 16


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("export", ["gpt2.onnx", "gpt2-dynamo.onnx"])
def test_a_gpt2_export_trains_on_tokenized_text_and_samples_text_with_the_runs_tokenizer(tmp_path, export):
    raw = {"name": "tok", "output_dir": str(tmp_path / "run"), "model": {"path": str(export_path(export))},
           "data": {"train": [str(CORPUS)], "format": "text", "eval_fraction": 0.05,
                    "text": {"seq_len": SEQ, "tokenizer": str(TOKENIZER)}},
           "train": {"batch_size": 2, "num_train_steps": 2, "evaluation_period": 0, "max_eval_rows": 8}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert "valid" in _invoke("validate", str(config))
    _invoke("configure", str(config))
    _invoke("prepare-data", str(config))
    cfg = load_run_config(tmp_path / "run")
    tok = open_tokenizer(TOKENIZER)
    batch = next(TrainLoader(cfg.data_dir, 64, 0, 1, prefetch=0).iter_from(0))["input_ids"]
    assert batch.max() > 255 and batch.max() < 512  # the tokenizer's merged ids, within the 512-row embedding
    assert tok.decode(batch[0].tolist()) in CORPUS.read_text()  # a window of the corpus, decoded back

    job = run_ranks(cfg)
    assert job.returncode == 0, job.stdout
    assert "eval loss" in _invoke("evaluate", str(cfg.output_dir))
    _invoke("export", str(cfg.output_dir))
    model = cfg.output_dir / "export" / "model.onnx"
    # The run's tokenizer and window by default: the prompt's ids in, text out.
    printed = _invoke("sample", str(model), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0")
    expected = generate(model, "def ", 12, temperature=0, seq_len=SEQ, tokenizer=tok)
    assert printed == f"def {expected}\n"
    assert expected.strip()  # text the trained model generated, decoded by the run's tokenizer
