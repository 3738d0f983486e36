"""The tokenizer file of a text corpus (``data.text.tokenizer``): a Hugging Face ``tokenizers`` JSON file.

``tokenizers`` is the ``text`` extra (``pip install 'ortflow[text]'``). Only the fast tokenizer's single
``tokenizer.json`` loads here; a model's slow-tokenizer files (GPT-2's ``vocab.json`` + ``merges.txt``, Llama's
SentencePiece ``tokenizer.model``) are refused with the way to write a ``tokenizer.json`` from them. The ids a
tokenizer can emit (its vocabulary, added tokens included) must be rows of the embedding table the model's token input
indexes (:func:`vocab_problem`; the tables come from :mod:`ortflow.graph.exports.token_tables`): the engine does not
check ids, and one past the table fails a training step or reads past it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ortflow.dataprep.errors import DataError

#: What the refusals of a file that is not a tokenizers JSON tell the user to do.
HOW_TO_GET = (
    "give the model's tokenizer.json (a Hugging Face model folder holds it; otherwise write it with "
    "`transformers.AutoTokenizer.from_pretrained(MODEL).save_pretrained(DIR)`, which converts a model's vocab.json + "
    "merges.txt or SentencePiece tokenizer.model to DIR/tokenizer.json)"
)

class TextTokenizer:
    """A loaded ``tokenizers`` file: encode text to ids, decode ids to text, and the range of its ids."""

    def __init__(self, tokenizer, path: Path):
        self._tok = tokenizer
        self.path = path
        #: sha256 of the file: prepared data records it (a tokenizer rewritten in place makes other ids).
        self.digest = tokenizer_digest(path)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        #: One past the largest id the tokenizer emits (its vocabulary size when the ids are 0..n-1).
        self.num_ids = max(vocab.values(), default=-1) + 1

    def encode_lines(self, lines: list[str]) -> list[list[int]]:
        """The ids of each line (no special tokens added: the corpus is one stream)."""
        return [enc.ids for enc in self._tok.encode_batch(lines, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens kept)."""
        return self._tok.decode(ids, skip_special_tokens=False)


def open_tokenizer(path: Path, field: str = "data.text.tokenizer") -> TextTokenizer:
    """Load a ``tokenizers`` JSON file.

    Raises:
        DataError: ``tokenizers`` is not installed, or ``path`` is missing, a folder, or not a tokenizers JSON
            (each message says which file to give and how to get it).
    """
    path = Path(path)
    try:
        from tokenizers import Tokenizer  # the `text` extra, only for tokenizer files
    except ImportError:
        raise DataError(
            f"{field} names {path}, which needs the `tokenizers` package: pip install 'ortflow[text]' (or remove "
            f"{field} to use the byte-level tokenizer)"
        ) from None
    if not path.exists():
        raise DataError(f"{field}: {path} does not exist; check the path")
    if path.is_dir():
        inside = path / "tokenizer.json"
        if inside.is_file():
            raise DataError(f"{field}: {path} is a folder; give the file in it: {inside}")
        raise DataError(f"{field}: {path} is a folder without a tokenizer.json; {HOW_TO_GET}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own exception type for a file it cannot read
        what = _kind(path)
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{field}: {path} is {what}, not a `tokenizers` JSON file ({detail}); {HOW_TO_GET}") from None
    return TextTokenizer(tok, path)


def tokenizer_digest(path: Path | None) -> str | None:
    """sha256 of a tokenizer file (None without one, or when it cannot be read): what prepared data depends on."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path is not None else None
    except OSError:
        return None


def _kind(path: Path) -> str:
    """What a file that is not a tokenizers JSON probably is, from its name."""
    name = path.name.lower()
    if name.endswith(".model"):
        return "a SentencePiece model (Llama's tokenizer.model)"
    if name == "vocab.json" or name.endswith("merges.txt") or name == "vocab.txt":
        return f"a slow tokenizer's {path.name} (one of several files)"
    if name == "tokenizer_config.json":
        return "the tokenizer's settings (tokenizer_config.json), not the tokenizer itself"
    return "a file that cannot be read as a tokenizer"


def load_tokenizer(path: Path | None):
    """A function ``list[str] -> list[list[int]]`` for a ``tokenizers`` JSON file; None means byte-level."""
    if path is None:
        return None
    return open_tokenizer(path).encode_lines


def vocab_problem(tokenizer: TextTokenizer, input_name: str, tables: list[tuple[str, int]]) -> str | None:
    """The refusal of a tokenizer whose ids do not all fit a table that ``input_name`` indexes, or None.

    Byte-level text is not refused here: its ids are the bytes the corpus holds, checked as labels against the
    loss output's classes (:mod:`ortflow.dataprep.values`).

    Args:
        tokenizer: The text's tokenizer.
        input_name: The model input that receives the ids (``data.text.input_name``).
        tables: ``(table, rows)`` of each embedding table the input indexes.
    """
    num_ids = tokenizer.num_ids
    short = [(table, rows) for table, rows in tables if rows < num_ids]
    if not short:
        return None
    table, rows = min(short, key=lambda t: t[1])
    return (
        f"data.text.tokenizer: {tokenizer.path} has a vocabulary of {num_ids} (ids 0..{num_ids - 1}), but the model's "
        f"input '{input_name}' indexes embedding table '{table}' of {rows} rows, so ids {rows}..{num_ids - 1} would "
        f"read past it; give the tokenizer the model was made for (its tokenizer.json), or export the model with an "
        f"embedding of at least {num_ids} rows (transformers: model.resize_token_embeddings({num_ids}) before the "
        f"export)"
    )
