"""PyTorch FSDP2 + torch.compile on the Llama shape of ``tools/make_large_llama.py``: the contender of
``bench/large_llama.py``, one process per GPU (``torchrun --nproc_per_node=N``).

The shape comes from the JSON line ``tools/make_large_llama.py`` printed (``--summary``). The model is Hugging
Face's ``LlamaForCausalLM`` from ``LlamaConfig`` when transformers is importable, else the same architecture
written here (RMSNorm, rotary embeddings, grouped key/value heads, SwiGLU, untied head; SDPA attention).
``fully_shard`` on every block and the root with bf16 parameters and fp32 gradient reduction
(``MixedPrecisionPolicy``), each block compiled; fused AdamW (lr 1e-4); the same synthetic next-token data rule (a
new batch every update) and the same per-GPU batch as ortflow's runs; the host waits for each update's loss, as
ortflow's loop does. Rank 0 prints one ``RESULT`` line: median step time over the updates after ``--warmup``,
tokens/s, first and last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.large_llama import add_workload  # noqa: E402 - the path above makes bench importable from any folder


class Shape:
    """The model's shape from the summary ``tools/make_large_llama.py`` prints (its ``shape``), without onnx."""

    def __init__(self, d_model, layers, heads, kv_heads, ffn, vocab, rope_theta=10000.0, eps=1e-5):
        self.d_model, self.layers, self.heads, self.kv_heads = d_model, layers, heads, kv_heads
        self.ffn, self.vocab, self.rope_theta, self.eps = ffn, vocab, rope_theta, eps
        self.head_dim = d_model // heads

    @classmethod
    def from_summary(cls, path: Path) -> Shape:
        line = next(x for x in Path(path).read_text().splitlines() if x.startswith("{"))
        return cls(**json.loads(line)["shape"])


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Block(nn.Module):
    def __init__(self, s):
        super().__init__()
        d, kv, self.s = s.d_model, s.kv_heads * s.head_dim, s
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, s.eps), RMSNorm(d, s.eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False), nn.Linear(d, kv, bias=False),
                                          nn.Linear(d, kv, bias=False), nn.Linear(d, d, bias=False))
        self.gate, self.up = nn.Linear(d, s.ffn, bias=False), nn.Linear(d, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        s, h = self.s, self.input_layernorm(x)
        q = _rope(self.q(h).view(b, t, s.heads, s.head_dim).transpose(1, 2), cos, sin)
        k = _rope(self.k(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        v = self.v(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(att)
        h = self.post_attention_layernorm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """The architecture of tools/make_large_llama.py in torch (used when transformers is absent)."""

    def __init__(self, s):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm, self.lm_head = RMSNorm(s.d_model, s.eps), nn.Linear(s.d_model, s.vocab, bias=False)
        inv = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids):
        freqs = torch.outer(torch.arange(ids.shape[1], device=ids.device).float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(self.embed.weight.dtype), emb.sin().to(self.embed.weight.dtype)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build_model(s, prefer_transformers: bool = True):
    """(model, its blocks, a label): Hugging Face's LlamaForCausalLM when transformers is importable."""
    if prefer_transformers:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.ffn,
                                 num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                 num_key_value_heads=s.kv_heads, rms_norm_eps=s.eps, rope_theta=s.rope_theta,
                                 tie_word_embeddings=False, attn_implementation="sdpa")
            model = LlamaForCausalLM(config)
            return model, list(model.model.layers), "transformers LlamaForCausalLM"
        except ImportError:
            pass
    model = Llama(s)
    return model, list(model.layers), "bench/torch_llama.py Llama"


def _logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def token_batches(vocab: int, args, rank: int, world: int) -> torch.Tensor:
    """This rank's batch of every update, ``[steps, batch, seq + 1]``: ortflow's data rule (``bench/large_llama.py``:
    each token a fixed function of the previous one, 10% of them random), a new batch each update, the ranks' batches
    of an update distinct."""
    gen = torch.Generator().manual_seed(0)
    rows = args.steps * world * args.batch
    tokens = torch.empty((rows, args.seq + 1), dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (rows,), generator=gen)
    for t in range(args.seq):
        noise = torch.rand(rows, generator=gen) < 0.1
        tokens[:, t + 1] = torch.where(noise, torch.randint(0, vocab, (rows,), generator=gen),
                                       (tokens[:, t] * 37 + 11) % vocab)
    return tokens.reshape(args.steps, world, args.batch, args.seq + 1)[:, rank]


def run(args) -> dict:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else \
        torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    shape = Shape.from_summary(args.summary)
    model, blocks, label = build_model(shape, not args.no_transformers)
    model.to(device)
    params = sum(p.numel() for p in model.parameters())
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        if args.compile:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    batches = token_batches(shape.vocab, args, rank, world).to(device)
    times, losses = [], []
    for tokens in batches:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = _logits(model, tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())  # the host waits for the loss
        times.append(time.perf_counter() - start)
    step = statistics.median(times[args.warmup:] or times)
    dist.destroy_process_group()
    return {"contender": f"PyTorch FSDP2{' + compile' if args.compile else ''} bf16", "model": label,
            "parameters": params, "gpus": world, "batch": args.batch, "seq": args.seq, "step_time_s": step,
            "tokens_per_s": world * args.batch * args.seq / step, "first_loss": losses[0], "last_loss": losses[-1],
            "torch": torch.__version__, "status": "ok"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload(parser)
    parser.add_argument("--summary", type=Path, required=True,
                        help="the JSON line tools/make_large_llama.py printed for the model (its shape)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks")
    parser.add_argument("--no-transformers", action="store_true", help="the Llama written here even with transformers")
    args = parser.parse_args(argv)
    try:
        record = run(args)
    except Exception:  # noqa: BLE001 - the report shows the contender's failure instead of losing the other rows
        record = {"contender": "PyTorch FSDP2 + compile bf16", "status": "failed", "error": traceback.format_exc()}
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
