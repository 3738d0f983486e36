"""Export the small real models that tests train, with both of torch's exporters.

Models: Hugging Face GPT-2, Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention; and with multi-query attention,
``llama-mqa``), Qwen2 (Llama's shape with biases on the query, key and value projections), Phi-3 (Llama's shape with
one fused query/key/value projection and one fused gate/up projection), Gemma (Llama's shape with the embedding tied
to the LM head, ``(1 + weight)`` RMSNorm and GeGLU), GPT-NeoX (``neox``: one fused query/key/value projection laid
out per head, partial RoPE, attention and MLP in parallel), the encoder-decoder T5 (``input_ids``, ``attention_mask``
and ``decoder_input_ids`` in, cross-attention, relative position bias tables, the shared embedding tied to both stacks
and the LM head), BERT classifier and ViT classifier, a torch CNN with BatchNorm and a torch classifier of an LSTM and
a GRU layer (``rnn``); and, exported as a user exports a model they train from scratch, a fresh tiny GPT-2 with
torch's ``scaled_dot_product_attention`` (``gpt2-sdpa``) and a small MLP with BatchNorm1d (``bnmlp``). Run through
``tools/export_fixtures.sh``, which makes a
throwaway virtual environment with the pinned torch and transformers; ortflow itself never imports torch.

Each model is exported the way a user exports theirs:

- TorchScript exporter (``dynamo=False``): opset 17, eval mode, no constant folding, dynamic batch (and sequence) axes;
  one self-contained file (``gpt2.onnx``).
- Dynamo exporter, torch's default since 2.9: ``torch.onnx.export(model, args, path, dynamic_shapes=...)`` with the
  exporter's defaults (``optimize=True``, opset 18, weights in ``<name>.onnx.data``) as ``gpt2-dynamo.onnx``, and
  with ``optimize=False`` as ``gpt2-dynamo-noopt.onnx``.

The fresh tiny GPT-2 (``gpt2-sdpa``, default ``sdpa`` attention, not perturbed) is exported by TorchScript
(``gpt2-sdpa.onnx``: the exporter merges its equal-valued initializers, zero biases and unit LayerNorm weights) and by
dynamo with ``optimize=False`` (``gpt2-sdpa-dynamo-noopt.onnx``: the attention's scale is a ``CastLike``). The MLP
with BatchNorm1d (``bnmlp``) is exported by dynamo only: with its defaults (``bnmlp-dynamo.onnx``, the optimiser folds
the eval-mode BatchNorm into the Linear before it) and with ``optimize=False`` (``bnmlp-dynamo-noopt.onnx``).

Beside each model family, ``<family>.torch.json`` lists the torch parameters, buffers and state-dict keys with their
shapes (so tests need no torch), and ``<family>.safetensors`` holds the torch state dict the exports were made from;
for the CNN, the recurrent classifier, Qwen2, Phi-3, Gemma, GPT-NeoX and T5, ``<family>.grads.safetensors`` holds a
batch and torch's gradients on it.
Weights come from a fixed seed, and the dynamo exports' metadata is stripped of what names the exporting environment
(:func:`reproducible`), so a re-export with the same versions writes the same files byte for byte.

Usage: python tools/export_fixtures.py OUT_DIR [FAMILY ...]

With families named (``gpt2-sdpa bnmlp``), only theirs are exported and ``versions.json`` is updated in place: the
other families' entries stay as recorded, which needs the recorded torch, transformers, onnx and onnxscript versions
to be this environment's.
"""

import hashlib
import json
import re
import sys
from pathlib import Path

import onnx
import onnxscript
import safetensors.torch
import torch
import transformers
from torch import nn

OPSET = 17
#: Metadata the dynamo exporter writes on each node that ortflow never reads and that names the exporting environment:
#: the Python stack of the op (the paths of this script and of the virtual environment, this script's line numbers).
UNREPRODUCIBLE = ("pkg.torch.onnx.stack_trace",)
#: A Python object's address in a repr (``<function sym_min at 0x7fed4731df80>`` in ``namespace`` and
#: ``pkg.torch.onnx.class_hierarchy``): dropped, the rest of the value is kept.
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def perturb(model: nn.Module) -> None:
    """Give every parameter distinct values, as a trained model has.

    Freshly initialised LayerNorm weights are all ones and biases all zeros; the exporter merges initializers with
    equal values into one, which would tie parameters that are separate in the model.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))


def export(model: nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
           dynamic_axes: dict, fresh: bool = False) -> None:
    """The TorchScript export of ``model``, perturbed first unless ``fresh``."""
    if not fresh:
        perturb(model)
    model.eval()
    torch.onnx.export(model, args, str(path), input_names=input_names, output_names=output_names,
                      dynamic_axes=dynamic_axes, opset_version=OPSET, do_constant_folding=False, dynamo=False)
    onnx.checker.check_model(onnx.load(str(path)))


def _with_metadata(graph: onnx.GraphProto):
    """The graph, its values, initializers and nodes, and those of the graphs its nodes hold."""
    yield graph
    yield from (*graph.input, *graph.output, *graph.value_info, *graph.initializer)
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _with_metadata(sub)


def reproducible(path: Path) -> None:
    """Rewrite the ``.onnx`` file of a dynamo export without the metadata that differs between two exports of the
    same model: :data:`UNREPRODUCIBLE` keys dropped, :data:`ADDRESS` cut from the other values. What ortflow reads
    (``pkg.torch.onnx.fx_node``, ``name_scopes``, ``class_hierarchy``, the graph signature) is kept. The external
    data file is left as written."""
    model = onnx.load(str(path), load_external_data=False)
    protos = [model, *_with_metadata(model.graph)]
    for function in model.functions:
        protos += [function, *function.node]
    env = (str(Path(__file__).resolve().parent), sys.prefix)
    for proto in protos:
        kept = [(p.key, ADDRESS.sub("", p.value)) for p in proto.metadata_props if p.key not in UNREPRODUCIBLE]
        del proto.metadata_props[:]
        for key, value in kept:
            if any(place in value for place in env):
                sys.exit(f"{path}: metadata {key!r} names this environment: {value[:200]!r}")
            proto.metadata_props.add(key=key, value=value)
    path.write_bytes(model.SerializeToString())


def export_dynamo(model: nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
                  dynamic_axes: dict, optimize: bool, varargs: bool = True) -> list[str]:
    """The default exporter as a user calls it; returns the files written (the model and its external data).

    ``varargs``: the model's forward takes ``*args`` (``LogitsOnly``), so the dynamic shapes are one tuple with an
    entry per input; otherwise they are an entry per named input.
    """
    model.eval()
    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    dims = tuple({axis: torch.export.Dim.DYNAMIC for axis in dynamic_axes[name]} for name in input_names)
    torch.onnx.export(model, args, str(path), input_names=input_names, output_names=output_names,
                      dynamic_shapes=(dims,) if varargs else dims, dynamo=True, optimize=optimize)
    onnx.checker.check_model(str(path))
    reproducible(path)
    onnx.checker.check_model(str(path))
    return [p.name for p in (path, path.with_name(path.name + ".data")) if p.exists()]


def export_dynamo_alone(*args, **kwargs) -> list[str]:
    """:func:`export_dynamo` in a process of its own. ``torch.export`` of an ``nn.LSTM`` or ``nn.GRU`` keeps state
    in the process: a second export of the same model (a copy, or a new module with its state dict) finds the
    sequence axis static (``tracing inferred a static shape of 8``) and fails."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(export_dynamo, args, kwargs)


def torch_record(model: nn.Module, out: Path, family: str) -> None:
    """Write what torch calls the model's tensors (``<family>.torch.json``) and its state dict (safetensors)."""
    params = {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    first = {}
    ties = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append([first[id(p)], n])
        else:
            first[id(p)] = n
    record = {
        "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
        "tied": ties,
        "buffers": {n: list(b.shape) for n, b in model.named_buffers()},
        "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()},
        "all_parameter_names": sorted(params),
    }
    (out / f"{family}.torch.json").write_text(json.dumps(record, indent=1) + "\n")
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(state, str(out / f"{family}.safetensors"))


def both_exporters(family: str, model: nn.Module, args: tuple, out: Path, input_names: list[str],
                   output_names: list[str], dynamic_axes: dict, fresh: bool = False, varargs: bool = True,
                   alone: bool = False) -> dict:
    """TorchScript export, then the dynamo exports with and without optimisation, of one model.

    With ``fresh``, the freshly initialised model (before ``perturb``) is also exported with the dynamo exporter's
    defaults, as a user who starts training from scratch exports it: its equal-valued initializers (norm weights,
    zero biases) are what the exporter's optimisation merges. ``varargs`` as in :func:`export_dynamo`; with ``alone``,
    each dynamo export runs in a process of its own (:func:`export_dynamo_alone`).
    """
    files = {}
    if fresh:
        rng = torch.get_rng_state()
        written = export_dynamo(model, args, out / f"{family}-fresh-dynamo.onnx", input_names, output_names,
                                dynamic_axes, optimize=True)
        safetensors.torch.save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
                                    str(out / f"{family}-fresh.safetensors"))
        files = {name: "torch.onnx.export(dynamo=True) of the freshly initialised model" for name in written}
        files[f"{family}-fresh.safetensors"] = "the freshly initialised model's torch state dict"
        torch.set_rng_state(rng)
    export(model, args, out / f"{family}.onnx", input_names, output_names, dynamic_axes)
    torch_record(model, out, family)
    files[f"{family}.onnx"] = "torch.onnx.export(dynamo=False, opset_version=17, do_constant_folding=False)"
    for suffix, optimize in (("-dynamo", True), ("-dynamo-noopt", False)):
        written = (export_dynamo_alone if alone else export_dynamo)(
            model, args, out / f"{family}{suffix}.onnx", input_names, output_names, dynamic_axes, optimize, varargs)
        for name in written:
            files[name] = f"torch.onnx.export(dynamo=True, optimize={optimize})"
    return files


def torch_gradients(model: nn.Module, out: Path, family: str, inputs: dict[str, torch.Tensor],
                    labels: torch.Tensor) -> dict:
    """Write ``<family>.grads.safetensors``: a batch (``input.<name>``, ``labels``) and torch's gradient of the mean
    cross-entropy of the model in training mode on it (``grad.<parameter>``, BatchNorm with batch statistics; a
    language model's over every token of the batch), from the state dict the exports were made from; the model is
    left in eval mode with its state unchanged."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model.zero_grad()
    logits = model(*inputs.values())
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    tensors = {f"input.{k}": v.contiguous() for k, v in inputs.items()}
    tensors["labels"] = labels.contiguous()
    tensors.update({f"grad.{n}": p.grad.detach().contiguous().clone() for n, p in model.named_parameters()})
    model.zero_grad()
    model.load_state_dict(state)  # the running statistics the training-mode forward moved
    model.eval()
    safetensors.torch.save_file(tensors, str(out / f"{family}.grads.safetensors"))
    return {f"{family}.grads.safetensors": "a batch and torch's gradients of the mean cross-entropy on it "
                                           "(training mode), from the exported state dict"}


class LogitsOnly(nn.Module):
    """Returns the logits tensor alone (Hugging Face models return tuples)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args, return_dict=False)[0]


def gpt2(out: Path) -> tuple[dict, dict]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                  activation_function="gelu_new", tie_word_embeddings=True, use_cache=False,
                                  attn_implementation="eager")
    model = LogitsOnly(transformers.GPT2LMHeadModel(cfg))
    ids = torch.randint(0, 512, (2, 16))
    files = both_exporters("gpt2", model, (ids,), out, ["input_ids"], ["logits"],
                           {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}, fresh=True)
    return {"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 4, "n_head": 4,
            "activation_function": "gelu_new", "tie_word_embeddings": True, "attn_implementation": "eager",
            "inputs": {"input_ids": "int64 [batch, seq]"}, "outputs": {"logits": "float [batch, seq, 512]"}}, files


#: The tiny Llama-shaped decoders' configuration (Llama, Llama with multi-query attention, Qwen2, Phi-3).
DECODER = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "tie_word_embeddings": False, "attn_implementation": "eager"}


def _decoder(out: Path, family: str, model_class, config_class, fresh: bool = False,
             **changes) -> tuple[dict, dict, nn.Module]:
    """A tiny decoder LM of ``DECODER``'s shape (with ``changes``), exported by both exporters: its record, its
    files and the model."""
    torch.manual_seed(0)
    shape = {**DECODER, **changes}
    model = LogitsOnly(model_class(config_class(use_cache=False, **shape)))
    ids = torch.randint(0, 512, (2, 16))
    files = both_exporters(family, model, (ids,), out, ["input_ids"], ["logits"],
                           {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}, fresh=fresh)
    return {**shape, "inputs": {"input_ids": "int64 [batch, seq]"},
            "outputs": {"logits": "float [batch, seq, 512]"}}, files, model


def llama(out: Path) -> tuple[dict, dict]:
    record, files, _ = _decoder(out, "llama", transformers.LlamaForCausalLM, transformers.LlamaConfig, fresh=True)
    return record, files


def llama_mqa(out: Path) -> tuple[dict, dict]:
    """Llama's shape with multi-query attention (one key/value head for the 4 query heads, as Falcon and StarCoder
    have): the key/value projections stay whole on every tensor-parallel rank."""
    record, files, _ = _decoder(out, "llama-mqa", transformers.LlamaForCausalLM, transformers.LlamaConfig,
                                num_key_value_heads=1)
    return record, files


def qwen2(out: Path) -> tuple[dict, dict]:
    """Llama's shape with Qwen2's biases on the query, key and value projections (none on the output projection)."""
    record, files, model = _decoder(out, "qwen2", transformers.Qwen2ForCausalLM, transformers.Qwen2Config)
    files.update(torch_gradients(model, out, "qwen2", {"input_ids": torch.randint(0, 512, (8, 16))},
                                 torch.randint(0, 512, (8, 16))))
    return record, files


def phi3(out: Path) -> tuple[dict, dict]:
    """Llama's shape with Phi-3's fused projections: one ``qkv_proj`` Linear (the query, key and value rows stacked)
    and one ``gate_up_proj`` Linear (the gate and up rows stacked). No padding token: Phi-3's default (32000) is past
    the tiny vocabulary, and an embedding's padding row gets no gradient in torch, which an ONNX graph does not know."""
    record, files, model = _decoder(out, "phi3", transformers.Phi3ForCausalLM, transformers.Phi3Config,
                                    pad_token_id=None)
    files.update(torch_gradients(model, out, "phi3", {"input_ids": torch.randint(0, 512, (8, 16))},
                                  torch.randint(0, 512, (8, 16))))
    return record, files


def gemma(out: Path) -> tuple[dict, dict]:
    """Gemma: Llama's shape with the input embedding tied to the LM head (one parameter read by the first and the last
    layer), the embedding scaled by sqrt(hidden_size), RMSNorm scaling by (1 + weight) from weights initialised at
    zero, a GeGLU MLP (GELU, tanh approximation) and ``head_dim`` set on its own; grouped-query attention as
    Llama's, and the default ``pad_token_id`` 0 (torch's embedding gives row 0 no gradient of its own)."""
    record, files, model = _decoder(out, "gemma", transformers.GemmaForCausalLM, transformers.GemmaConfig,
                                    head_dim=16, tie_word_embeddings=True,
                                    hidden_activation="gelu_pytorch_tanh")
    files.update(torch_gradients(model, out, "gemma", {"input_ids": torch.randint(0, 512, (8, 16))},
                                 torch.randint(0, 512, (8, 16))))
    return record, files


#: The tiny GPT-NeoX's configuration (Pythia's architecture): no key/value head count of its own, so not ``DECODER``.
NEOX = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "rotary_pct": 0.25, "use_parallel_residual": True,
        "tie_word_embeddings": False, "attn_implementation": "sdpa"}


def neox(out: Path) -> tuple[dict, dict]:
    """GPT-NeoX (the Pythia models): one fused ``query_key_value`` Linear laid out per head (its output viewed as
    [batch, seq, heads, 3 * head_dim] and split into the query, key and value along the last axis), rotary embeddings
    on a quarter of each head (``rotary_pct`` 0.25), attention and MLP in parallel on the same layer-normed input
    (``use_parallel_residual``), LayerNorms with biases, an untied ``embed_out`` LM head. The default attention
    (``sdpa``), as a Pythia user loads it: the eager one multiplies the query and key as ``[batch * heads, seq,
    head_dim]``, which the tensor-parallel split keeps whole."""
    torch.manual_seed(0)
    model = LogitsOnly(transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(use_cache=False, **NEOX)))
    ids = torch.randint(0, 512, (2, 16))
    files = both_exporters("neox", model, (ids,), out, ["input_ids"], ["logits"],
                           {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    files.update(torch_gradients(model, out, "neox", {"input_ids": torch.randint(0, 512, (8, 16))},
                                 torch.randint(0, 512, (8, 16))))
    return {**NEOX, "inputs": {"input_ids": "int64 [batch, seq]"},
            "outputs": {"logits": "float [batch, seq, 512]"}}, files


#: The tiny T5's configuration (T5 v1.0: ReLU MLP, the shared embedding tied to both stacks' embeddings and to the
#: LM head, whose input is rescaled by d_model**-0.5); no dropout, so torch's training-mode gradients are the eval
#: graph's.
T5 = {"vocab_size": 512, "d_model": 64, "d_kv": 16, "num_heads": 4, "d_ff": 128, "num_layers": 2,
      "num_decoder_layers": 2, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
      "dropout_rate": 0.0, "feed_forward_proj": "relu", "tie_word_embeddings": True, "decoder_start_token_id": 0,
      "pad_token_id": 0}


def t5(out: Path) -> tuple[dict, dict]:
    """Hugging Face ``T5ForConditionalGeneration`` as a user exports it for training: ``input_ids``,
    ``attention_mask`` and ``decoder_input_ids`` in, the logits out (the loss is the trainer's). An encoder and a
    decoder stack with cross-attention, one relative position bias table per stack (in its first layer, read by
    every layer), T5LayerNorm (RMS, no bias), no biases anywhere. The batch of ``t5.grads.safetensors`` pads the ends
    of some encoder rows (mask 0) and has decoder rows of another length (12) than the encoder's (16); its labels are
    the decoder's next tokens."""
    torch.manual_seed(0)
    model = LogitsOnly(transformers.T5ForConditionalGeneration(transformers.T5Config(use_cache=False, **T5)))
    ids, dec = torch.randint(1, 512, (2, 16)), torch.randint(1, 512, (2, 12))
    mask = torch.ones(2, 16, dtype=torch.int64)
    files = both_exporters("t5", model, (ids, mask, dec), out, ["input_ids", "attention_mask", "decoder_input_ids"],
                           ["logits"], {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                        "decoder_input_ids": {0: "batch", 1: "decoder_seq"},
                                        "logits": {0: "batch", 1: "decoder_seq"}})
    ids = torch.randint(1, 512, (8, 16))
    mask = (torch.arange(16)[None, :] < torch.randint(10, 17, (8, 1))).to(torch.int64)
    target = torch.randint(1, 512, (8, 12))
    dec = torch.cat([torch.zeros(8, 1, dtype=torch.int64), target[:, :-1]], dim=1)  # shifted right, start token 0
    files.update(torch_gradients(model, out, "t5", {"input_ids": ids * mask, "attention_mask": mask,
                                                    "decoder_input_ids": dec}, target))
    return {**T5, "inputs": {"input_ids": "int64 [batch, seq]", "attention_mask": "int64 [batch, seq]",
                             "decoder_input_ids": "int64 [batch, decoder_seq]"},
            "outputs": {"logits": "float [batch, decoder_seq, 512]"}}, files


def bert(out: Path) -> tuple[dict, dict]:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, num_labels=3,
                                  attn_implementation="eager")
    model = LogitsOnly(transformers.BertForSequenceClassification(cfg))
    ids = torch.randint(0, 512, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    files = both_exporters("bert", model, (ids, mask), out, ["input_ids", "attention_mask"], ["logits"],
                           {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                            "logits": {0: "batch"}})
    return {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "num_labels": 3, "attn_implementation": "eager",
            "inputs": {"input_ids": "int64 [batch, seq]", "attention_mask": "int64 [batch, seq]"},
            "outputs": {"logits": "float [batch, 3]"}}, files


def vit(out: Path) -> tuple[dict, dict]:
    torch.manual_seed(0)
    shape = {"image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128, "num_labels": 10, "attn_implementation": "eager"}
    model = LogitsOnly(transformers.ViTForImageClassification(transformers.ViTConfig(**shape)))
    pixels = torch.randn(2, 3, 16, 16)
    files = both_exporters("vit", model, (pixels,), out, ["pixel_values"], ["logits"],
                           {"pixel_values": {0: "batch"}, "logits": {0: "batch"}})
    return {**shape, "inputs": {"pixel_values": "float [batch, 3, 16, 16]"},
            "outputs": {"logits": "float [batch, 10]"}}, files


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


def cnn(out: Path) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = CNN()
    # Non-trivial running statistics, as a model trained before export has.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.9, 1.1)
    files = both_exporters("cnn", model, (torch.randn(2, 1, 16, 16),), out, ["pixels"], ["logits"],
                           {"pixels": {0: "batch"}, "logits": {0: "batch"}}, varargs=False)
    files.update(torch_gradients(model, out, "cnn", {"pixels": torch.randn(8, 1, 16, 16)},
                                 torch.randint(0, 10, (8,))))
    return {"layers": "Conv(1->8,3)+BN+ReLU, Conv(8->16,3,s2)+BN+ReLU, mean over H,W, Linear(16->10)",
            "inputs": {"pixels": "float [batch, 1, 16, 16]"}, "outputs": {"logits": "float [batch, 10]"}}, files


class RNN(nn.Module):
    """A recurrent classifier: token embedding, one LSTM layer, one GRU layer (batch first), a linear head on the
    last step's state."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True)
        self.gru = nn.GRU(24, 24, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, input_ids):
        states, _ = self.lstm(self.embed(input_ids))
        states, _ = self.gru(states)
        return self.head(states[:, -1])


def rnn(out: Path) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = RNN()
    files = both_exporters("rnn", model, (torch.randint(0, 64, (2, 8)),), out, ["input_ids"], ["logits"],
                           {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}, varargs=False, alone=True)
    files.update(torch_gradients(model, out, "rnn", {"input_ids": torch.randint(0, 64, (8, 12))},
                                 torch.randint(0, 5, (8,))))
    return {"layers": "Embedding(64, 16), LSTM(16->24), GRU(24->24), batch first, Linear(24->5) on the last step",
            "inputs": {"input_ids": "int64 [batch, seq]"}, "outputs": {"logits": "float [batch, 5]"}}, files


def gpt2_sdpa(out: Path) -> tuple[dict, dict]:
    """A fresh tiny GPT-2 with the default attention (torch's scaled_dot_product_attention), as a user who trains it
    from scratch exports it: TorchScript (equal-valued initializers merged) and dynamo with ``optimize=False``."""
    torch.manual_seed(0)
    shape = {"vocab_size": 512, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2,
             "activation_function": "gelu_new", "tie_word_embeddings": True, "attn_implementation": "sdpa"}
    model = LogitsOnly(transformers.GPT2LMHeadModel(transformers.GPT2Config(use_cache=False, **shape)))
    ids = torch.randint(0, 512, (2, 16))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    export(model, (ids,), out / "gpt2-sdpa.onnx", ["input_ids"], ["logits"], axes, fresh=True)
    torch_record(model, out, "gpt2-sdpa")
    files = {"gpt2-sdpa.onnx": "torch.onnx.export(dynamo=False, opset_version=17, do_constant_folding=False) of the "
                               "freshly initialised model"}
    written = export_dynamo(model, (ids,), out / "gpt2-sdpa-dynamo-noopt.onnx", ["input_ids"], ["logits"], axes,
                            optimize=False)
    files.update({name: "torch.onnx.export(dynamo=True, optimize=False) of the freshly initialised model"
                  for name in written})
    return {**shape, "inputs": {"input_ids": "int64 [batch, seq]"},
            "outputs": {"logits": "float [batch, seq, 512]"}}, files


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, ReLU, Linear: a BatchNorm right after the layer the dynamo optimiser folds it into."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, features):
        return self.fc2(torch.relu(self.bn(self.fc1(features))))


def bnmlp(out: Path) -> tuple[dict, dict]:
    """The MLP with BatchNorm1d, trained-looking (perturbed parameters, non-trivial running statistics), from the
    dynamo exporter with its defaults (the BatchNorm folded) and with ``optimize=False`` (kept)."""
    torch.manual_seed(0)
    model = BatchNormMLP()
    perturb(model)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.1, 0.1)
        model.bn.running_var.uniform_(0.9, 1.1)
    torch_record(model, out, "bnmlp")
    args = (torch.randn(4, 8),)
    files = {}
    for suffix, optimize in (("-dynamo", True), ("-dynamo-noopt", False)):
        written = export_dynamo(model, args, out / f"bnmlp{suffix}.onnx", ["features"], ["logits"],
                                {"features": {0: "batch"}, "logits": {0: "batch"}}, optimize, varargs=False)
        files.update({name: f"torch.onnx.export(dynamo=True, optimize={optimize})" for name in written})
    return {"layers": "Linear(8->16), BatchNorm1d(16), ReLU, Linear(16->3)",
            "inputs": {"features": "float [batch, 8]"}, "outputs": {"logits": "float [batch, 3]"}}, files


FAMILIES = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "cnn": cnn, "gpt2-sdpa": gpt2_sdpa,
            "bnmlp": bnmlp, "rnn": rnn, "qwen2": qwen2, "llama-mqa": llama_mqa,
            "phi3": phi3, "gemma": gemma, "neox": neox, "t5": t5}


def family_of(name: str) -> str:
    """The family a fixture file belongs to (``gpt2-fresh-dynamo.onnx`` -> ``gpt2``, ``gpt2-sdpa.onnx`` ->
    ``gpt2-sdpa``)."""
    return max((f for f in FAMILIES if name.startswith((f"{f}.", f"{f}-"))), key=len)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    wanted = sys.argv[2:] or list(FAMILIES)
    unknown = sorted(set(wanted) - set(FAMILIES))
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
                "onnxscript": onnxscript.__version__}
    recorded = out / "versions.json"
    old = {"models": {}, "files": {}}
    if sys.argv[2:] and recorded.exists():  # the other families' entries stay as recorded
        old = json.loads(recorded.read_text())
        if {k: old[k] for k in versions} != versions:
            sys.exit(f"{recorded} records {({k: old[k] for k in versions})}, this environment has {versions}: "
                     "re-export every family")
    models, written = {}, {}
    for family in FAMILIES:  # in this order whichever are exported, so that versions.json is the same either way
        if family in wanted:
            models[f"{family}.onnx"], written[family] = FAMILIES[family](out)
        elif f"{family}.onnx" in old["models"]:
            models[f"{family}.onnx"] = old["models"][f"{family}.onnx"]
            written[family] = {name: why for name, why in old["files"].items() if family_of(name) == family
                               and name not in (f"{family}.torch.json", f"{family}.safetensors")}
    files = {name: why for family in written for name, why in written[family].items()}
    for family in written:
        files[f"{family}.torch.json"] = "torch names and shapes of the model's parameters, buffers and state dict"
        files[f"{family}.safetensors"] = "the torch state dict the exports were made from"
    info = {**versions, "opset_torchscript": OPSET, "models": models, "files": files,
            "sha256": {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in sorted(files)}}
    recorded.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
