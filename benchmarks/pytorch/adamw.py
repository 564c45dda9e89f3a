"""PyTorch's AdamW on a flat parameter count, the peer of loom's
optimizer_step benchmark (benchmarks/training_features_bench.cpp): one
update, median of --steps, on the CPU with --threads threads. JSON lines.

--device cuda: the peer of benchmarks/adamw_gpu_bench.cu instead, on the GPU:
AdamW(fused=True), and the same after clip_grad_norm_(max_norm=1), each
update timed with CUDA events, in the lines scripts/gpu-check pairs
("benchmark", "batch": the parameter count, "metric": "ms").

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


def gpu_step_ms(step, steps, warmup):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        pairs.append((start, stop))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def gpu_lines(args):
    if not torch.cuda.is_available():
        print("benchmarks/pytorch/adamw.py: --device cuda, but this PyTorch sees no GPU",
              file=sys.stderr)
        sys.exit(1)
    name = torch.cuda.get_device_name()
    for n in args.parameters:
        weight = torch.full((n,), 0.01, device="cuda", requires_grad=True)
        weight.grad = torch.full((n,), 0.001, device="cuda")
        optimizer = torch.optim.AdamW([weight], lr=1e-3, fused=True)

        def clipped():
            torch.nn.utils.clip_grad_norm_([weight], 1.0)
            optimizer.step()

        for benchmark, step, bytes_per in (("adamw_update_gpu", optimizer.step, 28.0),
                                           ("adamw_update_clipped_gpu", clipped, 32.0)):
            ms = gpu_step_ms(step, args.steps, args.warmup)
            print(json.dumps({"benchmark": benchmark, "library": "pytorch",
                              "version": torch.__version__, "variant": "fused", "batch": n,
                              "parameters": n, "metric": "ms", "value": ms,
                              "higher_is_better": False, "gb_per_s": n * bytes_per / ms / 1e6,
                              "device": name}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parameters", type=int, nargs="+", default=[431080, 11200000])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        gpu_lines(args)
        return
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
