"""Export the small real models that tests train: a Hugging Face GPT-2, a Hugging Face BERT classifier and a torch CNN.

Run through ``tools/export_fixtures.sh``, which makes a throwaway virtual environment with the pinned torch and
transformers; ortflow itself never imports torch. Each model is exported the way a user exports theirs:
``torch.onnx.export`` (TorchScript exporter), opset 17, eval mode, no constant folding, dynamic batch (and sequence)
axes. Weights come from a fixed seed, so a re-export with the same versions writes the same graphs.

Usage: python tools/export_fixtures.py OUT_DIR
"""

import hashlib
import json
import sys
from pathlib import Path

import onnx
import torch
import transformers
from torch import nn

OPSET = 17


def perturb(model: nn.Module) -> None:
    """Give every parameter distinct values, as a trained model has.

    Freshly initialised LayerNorm weights are all ones and biases all zeros; the exporter merges initializers with
    equal values into one, which would tie parameters that are separate in the model.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))


def export(model: nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
           dynamic_axes: dict) -> None:
    perturb(model)
    model.eval()
    torch.onnx.export(model, args, str(path), input_names=input_names, output_names=output_names,
                      dynamic_axes=dynamic_axes, opset_version=OPSET, do_constant_folding=False, dynamo=False)
    onnx.checker.check_model(onnx.load(str(path)))


class LogitsOnly(nn.Module):
    """Returns the logits tensor alone (Hugging Face models return tuples)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args, return_dict=False)[0]


def gpt2(out: Path) -> dict:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                  activation_function="gelu_new", tie_word_embeddings=True, use_cache=False,
                                  attn_implementation="eager")
    model = LogitsOnly(transformers.GPT2LMHeadModel(cfg))
    ids = torch.randint(0, 512, (2, 16))
    export(model, (ids,), out / "gpt2.onnx", ["input_ids"], ["logits"],
           {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    return {"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 4, "n_head": 4,
            "activation_function": "gelu_new", "tie_word_embeddings": True, "attn_implementation": "eager",
            "inputs": {"input_ids": "int64 [batch, seq]"}, "outputs": {"logits": "float [batch, seq, 512]"}}


def bert(out: Path) -> dict:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, num_labels=3,
                                  attn_implementation="eager")
    model = LogitsOnly(transformers.BertForSequenceClassification(cfg))
    ids = torch.randint(0, 512, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    export(model, (ids, mask), out / "bert.onnx", ["input_ids", "attention_mask"], ["logits"],
           {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "logits": {0: "batch"}})
    return {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "num_labels": 3, "attn_implementation": "eager",
            "inputs": {"input_ids": "int64 [batch, seq]", "attention_mask": "int64 [batch, seq]"},
            "outputs": {"logits": "float [batch, 3]"}}


class CNN(nn.Module):
    """Two convolutions with BatchNorm, global average pooling, a linear classifier."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, pixels):
        return self.head(self.features(pixels).mean(dim=(2, 3)))


def cnn(out: Path) -> dict:
    torch.manual_seed(0)
    model = CNN()
    # Non-trivial running statistics, as a model trained before export has.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.9, 1.1)
    export(model, (torch.randn(2, 1, 16, 16),), out / "cnn.onnx", ["pixels"], ["logits"],
           {"pixels": {0: "batch"}, "logits": {0: "batch"}})
    return {"layers": "Conv(1->8,3)+BN+ReLU, Conv(8->16,3,s2)+BN+ReLU, mean over H,W, Linear(16->10)",
            "inputs": {"pixels": "float [batch, 1, 16, 16]"}, "outputs": {"logits": "float [batch, 10]"}}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    models = {"gpt2.onnx": gpt2(out), "bert.onnx": bert(out), "cnn.onnx": cnn(out)}
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
            "exporter": "torch.onnx.export(dynamo=False, do_constant_folding=False)", "opset": OPSET,
            "models": models,
            "sha256": {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in models}}
    (out / "versions.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
