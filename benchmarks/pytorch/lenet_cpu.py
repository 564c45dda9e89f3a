#!/usr/bin/python3
"""PyTorch peer of loom's CPU LeNet benchmark (benchmarks/lenet_throughput.cpp):
whole training steps (forward, cross-entropy, backward, SGD with momentum) of
the same network on the same consecutive real Fashion-MNIST batches, with the
same thread count, each step timed on the host's steady clock and the median
of the timed steps reported, as benchmarks/lenet_bench.hpp does for loom and
dlib. Prints one JSON line per batch size in that format ("library":
"pytorch"), so benchmarks/run can divide loom's images/s by these.

Real data only: a CPU figure on random data would not be the figure loom's
and dlib's runs give.
"""

import argparse
import os
import struct
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lenet import (FLOPS_PER_SAMPLE, MEAN, PARAMETERS, STD, cpu_step_ms,  # noqa: E402
                   emit, lenet, load_training_set)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="LeNet training-step throughput of PyTorch on the CPU (JSON lines)")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256],
                        help="batch sizes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=60,
                        help="timed steps per batch size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps first (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="intra-op threads, as loom's BLAS threads (default: %(default)s)")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                        help="Fashion-MNIST folder with the IDX files (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must not be negative")
    if args.threads < 1:
        parser.error(f"--threads {args.threads} must be at least 1")
    return args


def measure(torch, images, labels, batch, args):
    torch.manual_seed(0)
    model = lenet(torch.nn)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    median = cpu_step_ms(step, images, labels, batch, args.warmup, args.steps)
    emit({
        "benchmark": "lenet_train_step",
        "library": "pytorch",
        "backend": "cpu",
        "threads": args.threads,
        "batch": batch,
        "steps": args.steps,
        "median_step_ms": median,
        "images_per_s": 1000.0 * batch / median,
        "gflop_per_s": batch * FLOPS_PER_SAMPLE / median / 1e6,
        "torch": torch.__version__,
    })


def real_training_set(folder):
    """(images, labels, count) of the training split; SystemExit (status 1,
    the message on stderr) when it cannot be read or is missing."""
    try:
        train = load_training_set(folder)
    except (OSError, EOFError, ValueError, struct.error, zlib.error) as error:
        raise SystemExit(f"lenet_cpu.py: cannot read Fashion-MNIST from {folder}: {error}")
    if train is None:
        raise SystemExit(f"lenet_cpu.py: no Fashion-MNIST training files in {folder}; install "
                         f"Debian's dataset-fashion-mnist or pass --data DIR")
    return train


def main(argv):
    args = parse_args(argv)
    images_bytes, labels_bytes, count = real_training_set(args.data)
    for batch in args.batch:
        if not 1 <= batch <= count:
            print(f"lenet_cpu.py: --batch {batch} must be between 1 and the {count} training "
                  f"samples", file=sys.stderr)
            return 1
    # PyTorch's CPU GEMMs go to OpenBLAS's own thread pool, which
    # torch.set_num_threads does not size (loom's side: cpu::set_threads); it
    # reads this when the library loads, so before the import.
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    try:
        import torch
    except ImportError as error:
        print(f"lenet_cpu.py: PyTorch is needed ({error}); Debian's python3-torch installs it "
              f"for /usr/bin/python3", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    if torch.get_num_threads() != args.threads:
        print(f"lenet_cpu.py: PyTorch runs {torch.get_num_threads()} threads, not the "
              f"{args.threads} asked for", file=sys.stderr)
        return 1
    if sum(p.numel() for p in lenet(torch.nn).parameters()) != PARAMETERS:
        print(f"lenet_cpu.py: the network is not loom's LeNet ({PARAMETERS} parameters)",
              file=sys.stderr)
        return 1
    images = torch.frombuffer(bytearray(images_bytes), dtype=torch.uint8)
    images = images.view(count, 1, 28, 28).float().div_(255.0).sub_(MEAN).div_(STD)
    labels = torch.frombuffer(bytearray(labels_bytes), dtype=torch.uint8).long()
    for batch in args.batch:
        measure(torch, images, labels, batch, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
