"""PyTorch's AdamW on a flat parameter count, the peer of loom's
optimizer_step benchmark (benchmarks/training_features_bench.cpp): one
update, median of --steps, on the CPU with --threads threads. JSON lines.

fused=True is PyTorch's single-kernel AdamW; where this PyTorch has no fused
CPU AdamW (before 2.4) the multi-tensor foreach=True implementation, its
fastest there, is measured instead and the line says which ran."""
import argparse
import json
import statistics
import sys
import time

try:
    import torch
except ImportError:
    print("benchmarks/pytorch/adamw.py: torch is not installed (Debian: python3-torch)",
          file=sys.stderr)
    sys.exit(77)


def step_ms(params, optimizer, steps, warmup):
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parameters", type=int, nargs="+", default=[431080, 11200000])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for n in args.parameters:
        weight = torch.full((n,), 0.01, requires_grad=True)
        weight.grad = torch.full((n,), 0.001)
        variant = "fused"
        try:
            optimizer = torch.optim.AdamW([weight], lr=1e-3, fused=True)
            optimizer.step()
        except (TypeError, RuntimeError):
            variant = "foreach"
            optimizer = torch.optim.AdamW([weight], lr=1e-3, foreach=True)
        ms = step_ms(weight, optimizer, args.steps, args.warmup)
        print(json.dumps({"benchmark": "optimizer_step", "library": "pytorch",
                          "version": torch.__version__, "optimizer": "adamw",
                          "variant": variant, "parameters": n, "threads": args.threads,
                          "ms": ms, "gb_per_s": n * 4 * 7 / ms / 1e6}))


if __name__ == "__main__":
    main()
