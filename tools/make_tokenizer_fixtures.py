"""Train the tokenizer files the tests tokenize text with (tests/fixtures/tokenizers).

Both are byte-level BPE tokenizers, as GPT-2's is (``ByteLevel`` pre-tokenizer and decoder, the 256 byte symbols as the
initial alphabet, ``<|endoftext|>`` as the one special token), trained with the pinned ``tokenizers`` (the ``text``
extra) on ``tests/fixtures/corpus.txt``:

- ``bpe-512.json``: a vocabulary of 512, the rows of the GPT-2 and Llama fixture exports' embedding tables;
- ``bpe-1024.json``: a vocabulary of 1024, too large for them (validate refuses it).

The trainer is deterministic: running this again with the same ``tokenizers`` writes the same files byte for byte.

Usage: python tools/make_tokenizer_fixtures.py [OUT_DIR]   (default: tests/fixtures/tokenizers)
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "corpus.txt"
SIZES = {"bpe-512.json": 512, "bpe-1024.json": 1024}


def train(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens trained on the test corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise SystemExit(f"the corpus gives {tok.get_vocab_size(with_added_tokens=True)} tokens, not {vocab_size}")
    return tok


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "fixtures" / "tokenizers"
    out.mkdir(parents=True, exist_ok=True)
    for name, size in SIZES.items():
        train(size).save(str(out / name), pretty=False)
        print(f"{out / name}: vocabulary {size}")


if __name__ == "__main__":
    main()
