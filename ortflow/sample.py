"""Generate text from an exported language model with plain ONNX Runtime (no training engine).

The model takes token ids ``int64 [B, T]`` (T may be fixed, as in the bundled GPT example) and returns logits
``[B, T, V]``, ``[B*T, V]`` or ``[B, V]`` (next-token logits only). A batch dim fixed above 1 (a model exported
without dynamic axes) is filled with copies of the context and row 0 is read. Tokens are UTF-8 bytes (V = 256), the
data stage's default text tokenization, or the ids of a tokenizer (the run's ``data.text.tokenizer``), which encodes
the prompt and decodes what the model generates.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime


class SampleError(ValueError):
    """The model cannot be sampled from (wrong inputs or outputs)."""


class Tokenizer(Protocol):
    """Text <-> token ids (:class:`ortflow.dataprep.tokenizer.TextTokenizer`)."""

    num_ids: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _token_input(session: onnxruntime.InferenceSession, seq_len: int | None,
                 run_seq_len: int | None = None) -> tuple[str, int, int]:
    """The token-id input's name, the batch size to feed (its fixed batch dim, else 1) and the window length (the
    model's fixed one, else ``seq_len``, else the run's)."""
    inputs = session.get_inputs()
    if len(inputs) != 1 or "int64" not in inputs[0].type or len(inputs[0].shape) != 2:
        found = ", ".join(f"{i.name} {i.type} {i.shape}" for i in inputs)
        raise SampleError(
            f"expected one int64 [batch, tokens] input (token ids), found: {found}; sample works with causal "
            "language models whose only input is the token ids"
        )
    batch_dim, dim = inputs[0].shape
    batch = batch_dim if isinstance(batch_dim, int) and batch_dim > 0 else 1
    if isinstance(dim, int) and dim > 0:
        if seq_len is not None and seq_len != dim:
            raise SampleError(f"the model's input takes exactly {dim} tokens; drop --seq-len or pass {dim}")
        return inputs[0].name, batch, dim
    seq_len = seq_len if seq_len is not None else run_seq_len
    if seq_len is None:
        raise SampleError("the model's token dimension is symbolic: pass the context length with --seq-len")
    return inputs[0].name, batch, seq_len


def last_position_logits(logits: np.ndarray, batch: int, window: int) -> np.ndarray:
    """Row 0's logits at the last position, from ``[B, T, V]``, ``[B*T, V]`` or ``[B, V]`` outputs.

    Raises:
        SampleError: The output has none of these shapes.
    """
    if logits.ndim == 3 and logits.shape[:2] == (batch, window):
        return logits[0, -1]
    if logits.ndim == 2 and logits.shape[0] == batch * window:
        return logits.reshape(batch, window, -1)[0, -1]
    if logits.ndim == 2 and logits.shape[0] == batch:
        return logits[0]
    raise SampleError(
        f"the model's first output has shape {list(logits.shape)} for a batch of {batch} x {window} tokens; sample "
        f"reads logits shaped [{batch}, {window}, V], [{batch * window}, V] or [{batch}, V]"
    )


def sample_next(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """Pick one token from a row of logits: greedy at temperature 0, else softmax(logits / T) over the top k."""
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    if top_k is not None and 0 < top_k < scaled.size:
        cutoff = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled < cutoff, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    return int(rng.choice(scaled.size, p=probs))


def generate(
    model: Path | str,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    seq_len: int | None = None,
    on_token: Callable[[bytes], None] | None = None,
    tokenizer: Tokenizer | None = None,
    run_seq_len: int | None = None,
    byte_text: bool = False,
) -> str:
    """Continue ``prompt`` with tokens sampled from the model.

    The context is the last T tokens (left-padded with zeros when shorter); the next token is sampled from the logits
    at the last real position.

    Args:
        model: The exported ``.onnx`` model.
        prompt: Text to continue (UTF-8); an empty prompt starts from a newline.
        max_new_tokens: Tokens to generate.
        temperature: Softmax temperature; 0 picks the most likely token.
        top_k: Sample among the k most likely tokens only (None: all).
        seed: Seed of the sampler, for repeatable output.
        seq_len: Context length, only needed when the model's token dimension is symbolic.
        on_token: Receives the UTF-8 bytes of the text each generated token completes (to stream the output).
        tokenizer: Encodes the prompt and decodes the generated ids (None: tokens are bytes).
        run_seq_len: The window the model was trained on (``data.text.seq_len``), the context length when the model's
            token dimension is symbolic and ``seq_len`` is None.
        byte_text: The model was trained on text prepared as bytes (a run without a tokenizer): without a
            ``tokenizer``, only the 256 byte ids are sampled, whatever the model's vocabulary (a Hugging Face LM has
            more ids than the data ever held). Otherwise an id past the bytes is refused, naming ``--tokenizer``.

    Returns:
        The generated continuation (invalid UTF-8 sequences replaced).

    Raises:
        SampleError: the model is not a token-id -> logits model.
    """
    from ortflow.export.checksum import verify_model

    try:
        verify_model(Path(model), required=False)  # an exported model is checked; one from elsewhere has no sidecar
    except ValueError as err:
        raise SampleError(str(err)) from None
    try:
        session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - ONNX Runtime raises its own exception types for unloadable models
        raise SampleError(f"ONNX Runtime cannot load {model}: {err}") from None
    name, batch, window = _token_input(session, seq_len, run_seq_len)
    rng = np.random.default_rng(seed)
    tokens = (tokenizer.encode(prompt) if tokenizer is not None else list(prompt.encode("utf-8")))
    tokens = tokens or (tokenizer.encode("\n") if tokenizer is not None else [ord("\n")])
    start = len(tokens)
    shown = ""
    ids = np.zeros((batch, window), dtype=np.int64)
    for _ in range(max_new_tokens):
        context = tokens[-window:]
        ids[:] = 0
        ids[:, window - len(context):] = context  # every row the same context: a fixed batch dim is filled
        try:
            logits = session.run(None, {name: ids})[0]
        except Exception as err:  # noqa: BLE001 - a model that needs other inputs or shapes fails here
            raise SampleError(f"the model failed on token ids of shape {list(ids.shape)}: {err}") from None
        row = last_position_logits(logits, batch, window)
        token = sample_next(row[:256] if byte_text and tokenizer is None else row, temperature, top_k, rng)
        if tokenizer is None and token > 255:
            raise SampleError(f"the model predicts token {token}, not a byte: give the tokenizer its text was "
                              "prepared with (--tokenizer tokenizer.json)")
        if tokenizer is not None and token >= tokenizer.num_ids:
            raise SampleError(f"the model predicts token {token}, past the tokenizer's {tokenizer.num_ids} ids: give "
                              "the tokenizer its text was prepared with (--tokenizer tokenizer.json)")
        tokens.append(token)
        if on_token is not None and tokenizer is None:
            on_token(bytes([token]))
        elif on_token is not None:
            text = tokenizer.decode(tokens[start:])
            if text.startswith(shown) and not text.endswith("\ufffd"):  # a character split over tokens waits
                on_token(text[len(shown):].encode("utf-8"))
                shown = text
    if tokenizer is not None:
        text = tokenizer.decode(tokens[start:])
        if on_token is not None and text != shown and text.startswith(shown):  # the tail held back above
            on_token(text[len(shown):].encode("utf-8"))
        return text
    return bytes(tokens[start:]).decode("utf-8", errors="replace")
