#!/usr/bin/env python3
"""gpt_torch.py CHECKER WORK_DIR: PyTorch as the reference for loom's GPT layers.

CHECKER (gpt_torch_check) writes WORK_DIR/gpt.txt and WORK_DIR/gpt-rotary.txt
(the same GPT with rotary positions in its attention instead of a position
table), each: a small GPT's shapes, loom's initial parameters (flat, loom's
order), a batch of fortunes windows with their next-byte targets, and loom's
mean next-token loss and gradient in double and in float. This script builds
the same network in PyTorch, float64, from those parameters (nn.functional:
embedding, layer_norm, nanoGPT's masked softmax attention, Llama's rotary
positions, gelu, cross_entropy), takes the loss's gradient by autograd and
compares each file: loom's double to 1e-10 (loss)
and 1e-9 absolute + 1e-7 relative (gradient), loom's float to 1e-5
relative (loss) and 1e-4 of the largest gradient + 1e-3 relative.

Exit status: 0 agree, 1 differ, 77 (CTest's skip) when torch cannot be
imported, 2 for a wrong command line or a malformed file.
"""
import math
import os
import subprocess
import sys

SKIP = 77


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    checker, work = sys.argv[1], sys.argv[2]
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as error:
        print(f"skipped: torch cannot be imported ({error})")
        return SKIP
    subprocess.run([checker, work], check=True)
    failed = 0
    for name in ("gpt.txt", "gpt-rotary.txt"):
        failed += compare(os.path.join(work, name), torch, F)
    return 1 if failed else 0


def rotate(t, theta):
    """Rotary positions on [batch, heads, context, head width], the half-split layout."""
    import torch
    context, d = t.shape[-2], t.shape[-1]
    inverse = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(context, dtype=torch.float64)[:, None] * inverse[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    a, b = t[..., :d // 2], t[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def compare(path, torch, F):
    """The number of quantities in PATH that differ from PyTorch's."""
    with open(path) as f:
        lines = f.read().split("\n")
    context, width, heads, vocab, batch = (int(v) for v in lines[0].split()[:5])
    theta, positions = float(lines[0].split()[5]), int(lines[0].split()[6])
    floats = lambda i: [float(v) for v in lines[i].split()]
    flat = torch.tensor(floats(1), dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([int(float(v)) for v in lines[2].split()]).view(batch, context)
    targets = torch.tensor([int(v) for v in lines[3].split()]).view(batch * context)
    loss64, loss32 = floats(4)
    grad64 = torch.tensor(floats(5), dtype=torch.float64)
    grad32 = torch.tensor(floats(6), dtype=torch.float64)

    at = 0

    def take(*shape):
        nonlocal at
        count = 1
        for d in shape:
            count *= d
        t = flat[at:at + count].view(*shape)
        at += count
        return t

    W, H = width, heads
    x = F.embedding(ids, take(vocab, W))
    if positions:
        x = x + take(context, W)
    for _ in range(2):
        h = F.layer_norm(x, (W,), take(W), take(W), 1e-5)
        qkv = h @ take(3 * W, W).T + take(3 * W)
        q, k, v = (t.view(batch, context, H, W // H).transpose(1, 2) for t in qkv.split(W, dim=-1))
        if theta > 0:
            q, k = rotate(q, theta), rotate(k, theta)
        # nanoGPT's attention without flash (Debian's torch has no
        # scaled_dot_product_attention): masked scores, softmax, weighted sum.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(W // H)
        mask = torch.ones(context, context, dtype=torch.bool).triu(1)
        o = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        o = o.transpose(1, 2).reshape(batch, context, W)
        x = x + o @ take(W, W).T + take(W)
        h = F.layer_norm(x, (W,), take(W), take(W), 1e-5)
        h = F.gelu(h @ take(4 * W, W).T + take(4 * W))
        x = x + h @ take(W, 4 * W).T + take(W)
    x = F.layer_norm(x, (W,), take(W), take(W), 1e-5)
    logits = x @ take(vocab, W).T + take(vocab)
    if at != flat.numel():
        print(f"{path}: loom's parameters hold {flat.numel()} values, the network takes {at}")
        return 1
    loss = F.cross_entropy(logits.reshape(batch * context, vocab), targets)
    loss.backward()
    torch_grad = flat.grad

    failed = []

    def check(name, got, want, abs_tol, rel_tol):
        diff = (got - want).abs()
        bound = abs_tol + rel_tol * want.abs()
        worst = int(torch.argmax(diff - bound))
        if bool((diff > bound).any()):
            failed.append(f"{path}: {name}: index {worst} loom {float(got[worst])!r} torch "
                          f"{float(want[worst])!r}")

    want_loss = torch.tensor([loss.item()], dtype=torch.float64)
    check("double loss", torch.tensor([loss64], dtype=torch.float64), want_loss, 0.0, 1e-10)
    check("double gradient", grad64, torch_grad, 1e-9, 1e-7)
    check("float loss", torch.tensor([loss32], dtype=torch.float64), want_loss, 0.0, 1e-5)
    largest = float(torch_grad.abs().max())
    check("float gradient", grad32, torch_grad, 1e-4 * largest, 1e-3)
    for line in failed:
        print(line)
    print(f"{os.path.basename(path)}: loss torch {loss.item():.12f}, loom double {loss64:.12f}, "
          f"float {loss32:.8f}; {flat.numel()} parameters"
          + (f"; rotary positions, base {theta:g}" if theta > 0 else ""))
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
