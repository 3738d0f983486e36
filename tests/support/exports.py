"""The committed real exports (tools/export_fixtures.py), as users export them: Hugging Face GPT-2, Llama (and one with
multi-query attention), Qwen2, Phi-3, Gemma, GPT-NeoX, BERT, ViT and the encoder-decoder T5, a torch CNN with
BatchNorm and a torch LSTM + GRU classifier, from torch's TorchScript exporter and its dynamo exporter, a fresh tiny
GPT-2 with sdpa attention and an MLP with BatchNorm1d, with the torch names and shapes of each model's tensors beside
them."""

import hashlib
import json
from pathlib import Path

EXPORTS = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
VERSIONS = json.loads((EXPORTS / "versions.json").read_text())
# TorchScript exports (dynamo=False, opset 17).
NAMES = ("gpt2.onnx", "bert.onnx", "cnn.onnx", "llama.onnx", "vit.onnx", "rnn.onnx", "qwen2.onnx", "llama-mqa.onnx",
         "phi3.onnx", "gemma.onnx", "neox.onnx", "t5.onnx")
# Dynamo exports (torch's default exporter): with the exporter's default optimisation, without it, and of the freshly
# initialised model (whose equal-valued initializers the optimisation merges).
DYNAMO_NAMES = ("gpt2-dynamo.onnx", "gpt2-dynamo-noopt.onnx", "gpt2-fresh-dynamo.onnx",
                "llama-dynamo.onnx", "llama-dynamo-noopt.onnx", "llama-fresh-dynamo.onnx",
                "bert-dynamo.onnx", "bert-dynamo-noopt.onnx", "vit-dynamo.onnx", "vit-dynamo-noopt.onnx",
                "cnn-dynamo.onnx", "cnn-dynamo-noopt.onnx", "rnn-dynamo.onnx", "rnn-dynamo-noopt.onnx",
                "qwen2-dynamo.onnx", "qwen2-dynamo-noopt.onnx", "llama-mqa-dynamo.onnx", "llama-mqa-dynamo-noopt.onnx",
                "phi3-dynamo.onnx", "phi3-dynamo-noopt.onnx", "gemma-dynamo.onnx", "gemma-dynamo-noopt.onnx",
                "neox-dynamo.onnx", "neox-dynamo-noopt.onnx", "t5-dynamo.onnx", "t5-dynamo-noopt.onnx")
#: Dynamo exports with the exporter's defaults that configure refuses, naming ``optimize=False``: the optimisation
#: dropped the fresh GPT-2's zero biases, folded the CNN's BatchNorms into its convolutions, wrote the LSTM's and
#: GRU's weights in the ONNX ops' gate order as new tensors, and folded Gemma's RMSNorm weights into the constants
#: ``1 + weight``.
REFUSED_DYNAMO = ("gpt2-fresh-dynamo.onnx", "cnn-dynamo.onnx", "rnn-dynamo.onnx", "gemma-dynamo.onnx")

# Exports that pin what each exporter writes where ortflow rewrites or refuses it: a fresh tiny GPT-2 with torch's
# scaled_dot_product_attention from TorchScript (equal-valued initializers merged, read through Identity) and from
# dynamo with optimize=False (the attention's scale a CastLike); an MLP whose BatchNorm1d follows a Linear, from dynamo
# with its defaults (the BatchNorm folded into the Linear's Gemm) and with optimize=False (kept).
PATTERN_NAMES = ("gpt2-sdpa.onnx", "gpt2-sdpa-dynamo-noopt.onnx", "bnmlp-dynamo.onnx", "bnmlp-dynamo-noopt.onnx")


def export_path(name: str) -> Path:
    """Path of a committed export, after checking it is the file tools/export_fixtures.py wrote."""
    path = EXPORTS / name
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != VERSIONS["sha256"][name]:
        raise RuntimeError(f"{path} differs from the export recorded in versions.json: re-run tools/export_fixtures.sh")
    return path


def family(name: str) -> str:
    """The model family an export belongs to, as tools/export_fixtures.py names it: the longest family its name starts
    with (``llama-mqa-dynamo.onnx`` -> ``llama-mqa``, ``llama-fresh-dynamo.onnx`` -> ``llama``)."""
    families = (model.removesuffix(".onnx") for model in VERSIONS["models"])
    return max((f for f in families if name.startswith((f"{f}.", f"{f}-"))), key=len)


def torch_record(family: str) -> dict:
    """Torch names of a family's ``parameters``, ``buffers``, ``state_dict`` (name -> shape) and ``tied`` pairs."""
    return json.loads((EXPORTS / f"{family}.torch.json").read_text())
