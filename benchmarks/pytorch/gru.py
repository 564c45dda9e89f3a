#!/usr/bin/env python3
"""PyTorch peer of loom's GRU benchmarks, on real Fashion-MNIST images read as
28 rows of 28 pixels (loom's normalisation). JSON lines.

On the CPU (default): the GRU example's network, nn.GRU(28, 128) whose last
hidden state feeds Linear(64), ReLU, Linear(10), one training step
(forward, mean cross-entropy, backward, SGD lr 0.01 momentum 0.9) on
consecutive batches, median of --steps after --warmup (upper middle, as loom's), with --threads
threads (OpenMP's and OpenBLAS's): the peer of deep_layers_bench's "row_gru" line
(benchmarks/gru_vs_pytorch runs both).

--device cuda: the peer of gru_accuracy_gpu_bench's "gru_layer_step" rows
instead: nn.GRU(28, 128) alone, forward and backward (input and weight
gradients, d(loss)/d(h) = 1/n) on the first n training images, FP32 with
TF32 off, each step timed with CUDA events, median of --steps after
--warmup; scripts/gpu-check pairs the rows by "benchmark" and "batch".
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lenet import (MEAN, STD, cpu_step_ms, emit, fp32_without_tf32,  # noqa: E402
                   load_training_set)

STEPS, FEATURES, HIDDEN = 28, 28, 128
PARAMETERS = 69_578  # loom's RowGru::parameter_count (benchmarks/deep_layers_bench.cpp)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=None,
                        help="batch sizes (default: 128 on the CPU, 64 256 on cuda)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps (default: 20 on the CPU, 50 on cuda)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first (default: 2 on the CPU, 5 on cuda)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads (default: %(default)s, as loom's)")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                        help="Fashion-MNIST folder with the IDX files (default: %(default)s)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.batch = args.batch or ([128] if cpu else [64, 256])
    args.steps = args.steps if args.steps is not None else (20 if cpu else 50)
    args.warmup = args.warmup if args.warmup is not None else (2 if cpu else 5)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps and --threads must be at least 1, --warmup at least 0")
    if any(batch < 1 for batch in args.batch):
        parser.error("every --batch must be at least 1")
    return args


def row_gru(nn):
    class RowGru(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(FEATURES, HIDDEN, batch_first=True)
            self.head = nn.Sequential(nn.Linear(HIDDEN, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            _, last = self.gru(x)
            return self.head(last[0])

    return RowGru()


def cpu_lines(torch, images, labels, args):
    torch.set_num_threads(args.threads)
    loss_fn = torch.nn.CrossEntropyLoss()
    for batch in args.batch:
        # A fresh network per batch, as loom's train_step_ms makes one.
        torch.manual_seed(0)
        model = row_gru(torch.nn)
        if sum(p.numel() for p in model.parameters()) != PARAMETERS:
            raise SystemExit(f"gru.py: the network is not loom's RowGru ({PARAMETERS} parameters)")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(x, y):
            optimizer.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            optimizer.step()

        ms = cpu_step_ms(step, images, labels, batch, args.warmup, args.steps)
        emit({"benchmark": "deep_train_step", "network": "row_gru", "library": "pytorch",
              "version": torch.__version__, "backend": "cpu", "threads": args.threads,
              "batch": batch, "steps": args.steps, "parameters": PARAMETERS,
              "median_step_ms": ms, "images_per_s": 1000.0 * batch / ms})


def gpu_lines(torch, images, args):
    if not torch.cuda.is_available():
        raise SystemExit(f"gru.py: --device cuda, but PyTorch {torch.__version__} sees no GPU")
    if not fp32_without_tf32(torch):
        raise SystemExit("gru.py: could not turn TF32 off")
    from adamw import gpu_step_ms  # each step between CUDA events, their median

    device = torch.device("cuda")
    torch.manual_seed(0)
    gru = torch.nn.GRU(FEATURES, HIDDEN, batch_first=True).to(device)
    name = torch.cuda.get_device_name(device)
    for n in args.batch:
        x = images[:n].to(device).requires_grad_(True)
        dh = torch.full((1, n, HIDDEN), 1.0 / n, device=device)
        inputs = [x, *gru.parameters()]

        def step():
            _, last = gru(x)
            torch.autograd.grad(last, inputs, grad_outputs=dh)

        ms = gpu_step_ms(step, args.steps, args.warmup)
        emit({"benchmark": "gru_layer_step", "library": "pytorch", "version": torch.__version__,
              "runner": "cudnn" if torch.backends.cudnn.is_acceptable(x) else "aten", "batch": n,
              "steps": STEPS, "features": FEATURES, "hidden": HIDDEN, "metric": "median_ms",
              "value": ms,
              "higher_is_better": False, "precision": "fp32", "data": "fashion-mnist",
              "device": name})


def main(argv):
    args = parse_args(argv)
    try:
        train = load_training_set(args.data)
    except (OSError, EOFError, ValueError) as error:
        print(f"gru.py: cannot read Fashion-MNIST from {args.data}: {error}", file=sys.stderr)
        return 1
    if train is None:
        print(f"gru.py: no Fashion-MNIST training files in {args.data}", file=sys.stderr)
        return 1
    images_bytes, labels_bytes, count = train
    for batch in args.batch:
        if batch > count:
            print(f"gru.py: --batch {batch} must be between 1 and the {count} training samples",
                  file=sys.stderr)
            return 1
    if args.device == "cpu":
        # PyTorch's CPU GEMMs go to OpenBLAS's own thread pool, which
        # torch.set_num_threads does not size (loom's side: cpu::set_threads).
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    try:
        import torch
    except ImportError as error:
        print(f"gru.py: PyTorch is needed ({error}); Debian: python3-torch for /usr/bin/python3",
              file=sys.stderr)
        return 77
    images = torch.frombuffer(bytearray(images_bytes), dtype=torch.uint8)
    images = images.view(count, STEPS, FEATURES).float().div_(255.0).sub_(MEAN).div_(STD)
    if args.device == "cpu":
        labels = torch.frombuffer(bytearray(labels_bytes), dtype=torch.uint8).long()
        cpu_lines(torch, images, labels, args)
    else:
        gpu_lines(torch, images, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
