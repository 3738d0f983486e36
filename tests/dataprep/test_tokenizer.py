"""Text tokenized with a Hugging Face tokenizers JSON file (data.text.tokenizer, the `text` extra): the pin, the
committed tokenizer fixtures, the embedding tables the ids must fit, the files refused and the data prepared."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx
import pytest
from dataprep_helpers import make_cfg

from ortflow.config.sealed import seal
from ortflow.dataprep import DataError, TrainLoader, prepare_data
from ortflow.dataprep.tokenizer import open_tokenizer
from ortflow.graph.exports.token_tables import token_tables
from tests.support.exports import export_path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"
GPT_INPUTS = [{"name": "input_ids", "dtype": "int64", "shape": ["B", "T"]},
              {"name": "labels", "dtype": "int64", "shape": ["N"]}]  # fmt: skip


def test_the_text_extra_pins_tokenizers_which_the_lock_and_make_setup_install():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["text"]
    pin = dict(item.split("==") for item in extra)["tokenizers"]
    assert version("tokenizers") == pin
    lock = (ROOT / "requirements.lock").read_text().split()
    assert f"tokenizers=={pin}" in lock
    hub = next(line for line in lock if line.lower().startswith("huggingface_hub=="))  # tokenizers' one dependency
    assert version("huggingface_hub") == hub.split("==")[1]
    assert '-c requirements.lock -e ".[dev,text]"' in (ROOT / "Makefile").read_text()


def test_the_tokenizer_fixtures_are_what_their_script_trains_with_the_pinned_tokenizers(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tokenizer_fixtures.py"), str(tmp_path)], check=True,
                   capture_output=True)
    for name, size in (("bpe-512.json", 512), ("bpe-1024.json", 1024)):
        assert (tmp_path / name).read_bytes() == (TOKENIZERS / name).read_bytes(), name
        assert open_tokenizer(TOKENIZERS / name).num_ids == size


@pytest.mark.parametrize("name", ["gpt2.onnx", "gpt2-dynamo.onnx", "llama.onnx", "llama-dynamo-noopt.onnx"])
def test_the_token_input_of_each_real_export_indexes_its_512_row_embedding(name):
    model = onnx.load(str(export_path(name)), load_external_data=False)
    tables = token_tables(model)
    assert list(tables) == ["input_ids"]
    [(table, rows)] = tables["input_ids"]
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    assert rows == 512 and dims[table] == [512, 64]


def test_the_embedding_table_is_found_through_reshapes_casts_and_identities():
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Identity", ["wte"], ["tied"]),
             helper.make_node("Reshape", ["ids", "flat"], ["ids_flat"]),
             helper.make_node("Cast", ["ids_flat"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Gather", ["tied", "ids32"], ["emb"]),
             helper.make_node("Gather", ["pos", "positions"], ["pos_emb"])]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"]),
         helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, None)],
        [helper.make_tensor("wte", TensorProto.FLOAT, [300, 2], [0.0] * 600),
         helper.make_tensor("pos", TensorProto.FLOAT, [16, 2], [0.0] * 32),
         helper.make_tensor("flat", TensorProto.INT64, [1], [-1])],
    )
    assert token_tables(helper.make_model(graph)) == {"ids": [("wte", 300)], "positions": [("pos", 16)]}


def _slow_folder(root: Path) -> Path:
    folder = root / "gpt2-slow"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    return folder


def _sentencepiece_file(root: Path) -> Path:
    """The start of a SentencePiece model (a protobuf: its first piece, '<unk>', and a score)."""
    path = root / "tokenizer.model"
    path.write_bytes(b"\x0a\x0e\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda root: _slow_folder(root), "is a folder without a tokenizer.json"),
        (lambda root: _slow_folder(root) / "vocab.json", "is a slow tokenizer's vocab.json"),
        (lambda root: _sentencepiece_file(root), "is a SentencePiece model"),
    ],
    ids=["vocab-merges-folder", "vocab-json", "sentencepiece-model"],
)
def test_a_file_that_is_not_a_tokenizers_json_is_refused_saying_what_to_give_and_how_to_write_it(tmp_path, make,
                                                                                                    says):
    path = make(tmp_path)
    with pytest.raises(DataError) as err:
        open_tokenizer(path)
    message = str(err.value)
    assert message.startswith(f"data.text.tokenizer: {path} {says}"), message
    assert "tokenizer.json" in message and "AutoTokenizer.from_pretrained(MODEL).save_pretrained(DIR)" in message


def test_a_folder_holding_a_tokenizer_json_is_refused_naming_the_file_in_it(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_bytes((TOKENIZERS / "bpe-512.json").read_bytes())
    inside = tmp_path / "model" / "tokenizer.json"
    with pytest.raises(DataError, match=re.escape(f"is a folder; give the file in it: {inside}")):
        open_tokenizer(tmp_path / "model")


def test_a_tokenizer_file_without_the_tokenizers_package_names_the_text_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError, as when absent
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    (tmp_path / "tok.json").write_text("{}")
    cfg = make_cfg(tmp_path, [str(tmp_path / "a.txt")], inputs=GPT_INPUTS, text={"seq_len": 4, "tokenizer": "tok.json"})
    with pytest.raises(DataError, match=re.escape("needs the `tokenizers` package: pip install 'ortflow[text]'")):
        prepare_data(cfg)
    assert not cfg.data_dir.exists()


def _text_cfg(tmp_path: Path, tokenizer: Path, rows: int = 512, seq: int = 8):
    """A text run whose configure record says its input_ids index a table of ``rows`` rows."""
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(60))
    (tmp_path / "a.txt").write_text(text)
    cfg = make_cfg(tmp_path, [str(tmp_path / "a.txt")], inputs=GPT_INPUTS,
                   text={"seq_len": seq, "tokenizer": str(tokenizer)}, batch_size=1)
    record = {"train_inputs": GPT_INPUTS, "token_tables": {"input_ids": [["model.transformer.wte.weight", rows]]}}
    (cfg.output_dir / "configure.json").write_text(json.dumps(seal(record)))
    return cfg, text


def _stream(cfg, seq: int) -> np.ndarray:
    """The prepared windows of ``seq + 1`` tokens, sorted (the shards are shuffled): compared as a set."""
    loader = TrainLoader(cfg.data_dir, 1, 0, 1, prefetch=0)
    it = loader.iter_from(0)
    rows = [next(it) for _ in range(loader.num_samples)]
    windows = np.stack([np.concatenate([r["input_ids"][0], r["labels"].reshape(-1)[-1:]]) for r in rows])
    return windows[np.lexsort(windows.T[::-1])]


def _windows(ids: list[int], seq: int) -> np.ndarray:
    n = len(ids) // (seq + 1)
    windows = np.array(ids[: n * (seq + 1)], np.int64).reshape(n, seq + 1)
    return windows[np.lexsort(windows.T[::-1])]


def test_prepared_text_holds_the_tokenizers_ids_of_each_line_without_special_tokens(tmp_path):
    """A tokenizer whose post-processor adds a start token to each encoding (as Llama's tokenizer.json adds <s>)
    still gives one stream of the text's ids: prepare-data reads the corpus line by line and adds no special token."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(TOKENIZERS / "bpe-512.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                    bos)])
    tok.save(str(tmp_path / "with-bos.json"))
    cfg, text = _text_cfg(tmp_path, tmp_path / "with-bos.json")
    prepare_data(cfg)
    ids = [i for line in text.splitlines(keepends=True) for i in tok.encode(line, add_special_tokens=False).ids]
    assert max(ids) > 255  # merged tokens, not bytes
    got = _stream(cfg, 8)
    assert bos not in got
    np.testing.assert_array_equal(got, _windows(ids, 8))


def test_prepare_data_refuses_a_tokenizer_with_more_ids_than_the_embedding_has_rows(tmp_path):
    cfg, _ = _text_cfg(tmp_path, TOKENIZERS / "bpe-1024.json", rows=512)
    with pytest.raises(DataError) as err:
        prepare_data(cfg)
    assert str(err.value) == (
        f"data.text.tokenizer: {TOKENIZERS / 'bpe-1024.json'} has a vocabulary of 1024 (ids 0..1023), but the model's "
        "input 'input_ids' indexes embedding table 'model.transformer.wte.weight' of 512 rows, so ids 512..1023 would "
        "read past it; give the tokenizer the model was made for (its tokenizer.json), or export the model with an "
        "embedding of at least 1024 rows (transformers: model.resize_token_embeddings(1024) before the export)")
    assert not cfg.data_dir.exists()


def test_a_tokenizer_file_rewritten_in_place_prepares_the_data_again(tmp_path):
    """prepare-data's fingerprint and the prepare stage's cache key (`ortflow run`) hold the file's contents."""
    from ortflow.tasks.caching import stage_key

    path = tmp_path / "tokenizer.json"
    path.write_bytes((TOKENIZERS / "bpe-512.json").read_bytes())
    cfg, text = _text_cfg(tmp_path, path)
    assert not prepare_data(cfg).reused
    assert prepare_data(cfg).reused
    key = stage_key(cfg, "prepare_data")
    assert stage_key(cfg, "prepare_data") == key
    vocab = json.loads(path.read_text())
    vocab["model"]["merges"] = vocab["model"]["merges"][:100]  # a smaller tokenizer at the same path
    path.write_text(json.dumps(vocab))
    assert stage_key(cfg, "prepare_data") != key
    assert not prepare_data(cfg).reused
    tok = open_tokenizer(path)
    ids = [i for line in text.splitlines(keepends=True) for i in tok.encode(line)]
    np.testing.assert_array_equal(_stream(cfg, 8), _windows(ids, 8))
