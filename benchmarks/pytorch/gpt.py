#!/usr/bin/env python3
"""gpt.py --windows FILE [--tied]: the gpt_fortunes example's network in PyTorch, on the CPU.

nanoGPT's "baby GPT" over bytes (4 pre-norm blocks of 4-head causal
self-attention and a GELU MLP, width 128, context 64), written as nanoGPT
writes it (nn.Embedding, nn.LayerNorm, nn.Linear, masked softmax attention:
Debian's torch 1.13 has no scaled_dot_product_attention), started from
loom's initial weights and fed the windows that benchmarks/gpt_bench.cpp
--dump wrote, in the same order. JSON lines, as gpt_bench prints them:

  gpt_step         the median training step (AdamW) of --steps after --warmup,
                   the median step's time inside OpenBLAS's sgemm and
                   outside it (sgemm_ms, other_ms: where loom_sgemm_timer
                   is preloaded, as benchmarks/gpt_vs_pytorch does), and
                   the loss of the first batch at the initial weights
                   (--expect-initial-loss X: exit 1 unless it is X to 1e-5,
                   gpt_bench's figure, so that the two networks are one);
  attention_step   the attention alone at the network's shape, forward + backward;
  gpt_convergence  with --train-steps N instead: N steps with the example's
                   settings (AdamW lr 1e-3, weight decay 0.1, a 100-step warm-up
                   from a tenth, then a cosine to 0; clipping at norm 1), then
                   the mean loss over the validation windows' positions.
"""
import argparse
import ctypes
import json
import math
import os
import sys
import time



def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", required=True, help="gpt_bench --dump's file")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--expect-initial-loss", type=float, default=None)
    parser.add_argument("--tied", action="store_true",
                        help="the head's weight is the embedding's (nanoGPT's default)")
    return parser.parse_args(argv)


def read_windows(path):
    # Imported only now: Debian's numpy and PyTorch share one OpenBLAS, which
    # sizes its thread pool when it loads, and main() sets
    # OPENBLAS_NUM_THREADS first (imported at the top, numpy gave PyTorch's
    # GEMMs every core whatever --threads said).
    import numpy as np

    """The training windows, the validation windows and loom's initial parameters."""
    with open(path, "rb") as f:
        train, validation, context, parameters = (int(v) for v in np.frombuffer(f.read(32), np.int64))
        raw = f.read()
    expected = (train + validation) * (context + 1) + parameters * 4
    if len(raw) != expected:
        sys.exit(f"gpt.py: {path} holds {len(raw)} bytes after its header; expected {expected}")
    windows = np.frombuffer(raw, np.uint8, (train + validation) * (context + 1))
    windows = windows.reshape(train + validation, context + 1).astype(np.int64)
    flat = np.frombuffer(raw, np.float32, parameters, (train + validation) * (context + 1))
    return windows[:train], windows[train:], flat


def lr_factor(step, total, warmup=100, start=0.1):
    """loom's schedules::Warmup<schedules::Cosine>{100, 0.1, {}}."""
    if step < warmup:
        return start + (1.0 - start) * step / warmup
    rest = max(total - warmup, 0)
    if rest == 0:
        return 1.0
    progress = min(step - warmup, rest) / rest
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def main(argv):
    args = parse_args(argv)
    # PyTorch's CPU GEMMs go to OpenBLAS's own thread pool, which
    # torch.set_num_threads does not size (loom's side: cpu::set_threads); it
    # reads this when the library loads, so before numpy and torch.
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    try:
        import torch
        import torch.nn.functional as F
        from torch import nn
    except ImportError:
        sys.exit("gpt.py: PyTorch is missing; install Debian's python3-torch")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train, validation, flat = read_windows(args.windows)
    vocab, width, heads, context = 256, 128, 4, train.shape[1] - 1

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.register_buffer("mask", torch.ones(context, context, dtype=torch.bool).triu(1))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2)
                       for t in self.qkv(x).split(C, dim=2))
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // heads))
            o = F.softmax(scores.masked_fill(self.mask[:T, :T], float("-inf")), dim=-1) @ v
            return self.proj(o.transpose(1, 2).reshape(B, T, C))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x))))

    class BabyGpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Parameter(torch.zeros(context, width))
            self.blocks = nn.Sequential(*(Block() for _ in range(4)))
            self.ln = nn.LayerNorm(width)
            # Tied (loom's TiedLinear): nanoGPT's lm_head, no bias, its
            # weight the embedding's.
            self.head = nn.Linear(width, vocab, bias=not args.tied)
            if args.tied:
                self.head.weight = self.tokens.weight

        def forward(self, ids):
            return self.head(self.ln(self.blocks(self.tokens(ids) + self.positions)))

        def loom_order(self):
            """The parameters in loom's flat order (PyTorch's layouts are loom's)."""
            yield from (self.tokens.weight, self.positions)
            for b in self.blocks:
                yield from (b.ln1.weight, b.ln1.bias, b.attn.qkv.weight, b.attn.qkv.bias,
                            b.attn.proj.weight, b.attn.proj.bias, b.ln2.weight, b.ln2.bias,
                            b.fc.weight, b.fc.bias, b.fc2.weight, b.fc2.bias)
            yield from (self.ln.weight, self.ln.bias, self.head.weight)
            if not args.tied:
                yield self.head.bias

    model = BabyGpt()
    at = 0
    with torch.no_grad():
        for p in model.loom_order():
            p.copy_(torch.from_numpy(flat[at:at + p.numel()].copy()).view_as(p))
            at += p.numel()
    if at != len(flat):
        sys.exit(f"gpt.py: loom's network has {len(flat)} parameters, this one {at}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    line = {"library": "pytorch", "torch": torch.__version__,
            "network": "baby_gpt_tied" if args.tied else "baby_gpt",
            "parameters": sum(p.numel() for p in model.parameters()),  # a tied one once
            "batch": args.batch, "context": context, "threads": args.threads}

    def batch(windows, s):
        part = torch.from_numpy(windows[s * args.batch:(s + 1) * args.batch])
        return part[:, :-1], part[:, 1:].reshape(-1)

    def train_step(ids, targets, clip):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids).view(-1, vocab), targets)
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def emit(**fields):
        print(json.dumps({**line, **fields}, sort_keys=True, separators=(",", ":")), flush=True)

    if args.train_steps > 0:
        begin = time.perf_counter()
        for s in range(args.train_steps):
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * lr_factor(s, args.train_steps)
            train_step(*batch(train, s), clip=True)
        seconds = time.perf_counter() - begin
        total, count = 0.0, 0
        with torch.no_grad():
            for s in range((len(validation) + args.batch - 1) // args.batch):
                ids, targets = batch(validation, s)
                total += F.cross_entropy(model(ids).view(-1, vocab), targets,
                                         reduction="sum").item()
                count += targets.numel()
        emit(benchmark="gpt_convergence", steps=args.train_steps,
             validation_windows=len(validation), validation_loss=total / count,
             train_seconds=seconds)
        return 0

    with torch.no_grad():
        ids, targets = batch(train, 0)
        initial_loss = F.cross_entropy(model(ids).view(-1, vocab), targets).item()
    expected = args.expect_initial_loss
    if expected is not None and abs(initial_loss - expected) > 1e-5 * abs(expected):
        print(f"gpt.py: the first batch's loss at loom's weights is {initial_loss!r} here and "
              f"{expected!r} in loom: the networks differ", file=sys.stderr)
        return 1
    # The time inside sgemm, where benchmarks/gpt_vs_pytorch preloads
    # loom_sgemm_timer (benchmarks/pytorch/sgemm_timer.cpp) in front of OpenBLAS.
    try:
        sgemm_ns = ctypes.CDLL(None).sgemm_timer_ns
        sgemm_ns.restype = ctypes.c_int64
    except AttributeError:
        sgemm_ns = None
    times, sgemm_times = [], []
    for s in range(args.warmup + args.steps):
        ids, targets = batch(train, s)
        start, start_ns = time.perf_counter(), sgemm_ns() if sgemm_ns else 0
        train_step(ids, targets, clip=False)
        if s >= args.warmup:
            times.append((time.perf_counter() - start) * 1000.0)
            sgemm_times.append((sgemm_ns() - start_ns) / 1e6 if sgemm_ns else 0.0)
    step_ms = sorted(times)[len(times) // 2]
    split = {}
    if sgemm_ns:
        # The median step's split.
        sgemm_ms = sgemm_times[times.index(step_ms)]
        split = {"sgemm_ms": sgemm_ms, "other_ms": step_ms - sgemm_ms}
    emit(benchmark="gpt_step", steps=args.steps, median_step_ms=step_ms,
         tokens_per_s=args.batch * context / (step_ms / 1e3), initial_loss=initial_loss, **split)

    attention = Attention()
    with torch.no_grad():
        x = (model.tokens(batch(train, 0)[0]) + model.positions).detach()
    times = []
    for s in range(args.warmup + args.steps):
        start = time.perf_counter()
        y = attention(x.requires_grad_())
        y.backward(1e-3 * y.detach())
        x.grad = None
        attention.zero_grad(set_to_none=True)
        if s >= args.warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    del line["parameters"]
    line["network"] = "causal_self_attention"
    emit(benchmark="attention_step", steps=args.steps, width=width, heads=heads,
         median_step_ms=sorted(times)[len(times) // 2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
