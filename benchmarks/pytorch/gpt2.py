#!/usr/bin/env python3
"""gpt2.py: GPT-2 small's training step on one GPU in PyTorch, eager and under torch.compile.

The peer of benchmarks/gpt2_gpu_bench.cu: the same network (12 pre-norm
blocks of 12-head causal self-attention and a GELU MLP, width 768, context
1024, a vocabulary of 50257, learned positions, the head's weight the
embedding's unless --untied), written as nanoGPT writes it, with PyTorch's
fused attention (F.scaled_dot_product_attention, causal), AdamW (lr 3e-4,
weight decay 0.1) and, for bf16 and fp16, autocast over fp32 weights (fp16
with a GradScaler). Each step takes a new batch of --batch windows of
1025 bytes of Debian's fortunes (--data): ids below 256, as loom's side
takes them (the time does not depend on which ids).

One JSON line per precision and mode ("library" pytorch-eager or
pytorch-compile), as gpt2_gpu_bench prints them: "metric" tokens_per_s and
its "value" from the median of --steps timed steps after --warmup, each
timed from its start to torch.cuda.synchronize().
"""
import argparse
import json
import math
import os
import sys
import time


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/usr/share/games/fortunes")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", nargs="+", default=["bf16"],
                        choices=["fp32", "tf32", "bf16", "fp16"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"],
                        choices=["eager", "compile"])
    parser.add_argument("--untied", action="store_true",
                        help="the head a Linear of its own, not the embedding's weight")
    return parser.parse_args(argv)


CONTEXT, WIDTH, HEADS, LAYERS, VOCAB = 1024, 768, 12, 12, 50257


def read_text(folder):
    """The fortune files' bytes (the ones without an extension), in name order."""
    text = bytearray()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if "." in name or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            text += f.read()
    if len(text) < CONTEXT + 1:
        sys.exit(f"gpt2.py: {folder} holds {len(text)} bytes of text, fewer than a window of "
                 f"{CONTEXT + 1}")
    return bytes(text)


def build(torch, tied):
    from torch import nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(WIDTH, dim=2)
            q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(WIDTH)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(WIDTH)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                     nn.Linear(4 * WIDTH, WIDTH))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, WIDTH)
            self.wpe = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=not tied)
            if tied:
                self.head.weight = self.wte.weight

        def forward(self, ids, targets):
            x = self.wte(ids) + self.wpe
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1))

    return Gpt()


def measure(torch, args, text, precision, mode):
    torch.manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    model = build(torch, not args.untied).cuda()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    step_model = torch.compile(model) if mode == "compile" else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    windows = len(text) // (CONTEXT + 1)
    data = torch.frombuffer(bytearray(text[:windows * (CONTEXT + 1)]), dtype=torch.uint8)
    data = data.view(windows, CONTEXT + 1).long()
    times = []
    for step in range(args.warmup + args.steps):
        rows = [(step * args.batch + i) % windows for i in range(args.batch)]
        batch = data[rows].cuda(non_blocking=False)
        ids, targets = batch[:, :-1], batch[:, 1:]
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = step_model(ids, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        if not math.isfinite(loss.item()):
            sys.exit(f"gpt2.py: step {step}'s loss is {loss.item()}; the figures are void")
    timed = sorted(times[args.warmup:])
    median = timed[len(timed) // 2]
    name = "gpt2_small_untied_" if args.untied else "gpt2_small_"
    return {"benchmark": f"{name}{precision}", "library": f"pytorch-{mode}",
            "batch": args.batch, "context": CONTEXT, "parameters": parameters,
            "metric": "tokens_per_s", "value": args.batch * CONTEXT / (median / 1e3),
            "median_step_ms": median, "steps": len(timed),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def main(argv):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("gpt2.py: PyTorch is not installed")
    if not torch.cuda.is_available():
        sys.exit("gpt2.py: no CUDA device")
    text = read_text(args.data)
    for precision in args.precision:
        for mode in args.modes:
            print(json.dumps(measure(torch, args, text, precision, mode)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
