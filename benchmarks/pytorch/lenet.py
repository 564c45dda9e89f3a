#!/usr/bin/env python3
"""PyTorch peer of loom's GPU LeNet benchmark: training-step throughput of the
same network on one GPU, FP32 with TF32 off, the data already in GPU memory;
with --precision bf16 also under torch.autocast to bfloat16 (fp32 weights and
optimizer, as loom's bf16), as the benchmark "lenet_train_step_bf16"; with
fp16 under autocast to float16 with a GradScaler (dynamic loss scaling, as
loom's fp16), as "lenet_train_step_fp16".

Prints one JSON line per mode and batch size in the format of
benchmarks/lenet_bench.hpp, so scripts/gpu-check can divide loom's figure by
this one. PyTorch is imported only after the arguments are parsed and the
data set is read: --check-data runs (and the IDX reader is checked) where
PyTorch is absent.
"""

import argparse
import gzip
import json
import os
import statistics
import struct
import sys
import time

# loom's normalisation (include/loom/data/dataset.hpp).
MEAN, STD = 0.2860, 0.3530

# Forward + backward FLOPs of one sample as loom counts them (forward_flops and
# backward_flops of each layer), so that gflop_per_s means the same for every
# library. Conv2d: 2*Out*plane*patch + Out*plane forward, twice the GEMM term
# backward except for the first layer (no input gradient).
FLOPS_PER_SAMPLE = (
    (587_520 + 587_520)  # conv 1->20 5x5 (24x24 plane, patch 25)
    + (11_520 + 11_520)  # ReLU
    + (11_520 + 23_040)  # max-pool 2
    + (3_203_200 + 6_403_200)  # conv 20->50 5x5 (8x8 plane, patch 500)
    + (3_200 + 3_200)  # ReLU
    + (3_200 + 6_400)  # max-pool 2
    + (800_500 + 1_600_500)  # fc 800->500
    + (500 + 500)  # ReLU
    + (10_010 + 20_010)  # fc 500->10
)
PARAMETERS = 431_080  # loom's LeNet::parameter_count

IDX_IMAGES, IDX_LABELS = 0x00000803, 0x00000801  # unsigned bytes, 3 or 1 dimensions


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="LeNet training-step throughput of PyTorch on one GPU (JSON lines)")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024],
                        help="batch sizes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed steps per batch size and mode (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps first; they include torch.compile's compilation "
                             "(default: %(default)s)")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                        help="Fashion-MNIST folder with the IDX files; random data (marked "
                             "\"data\":\"random\") when they are missing (default: %(default)s)")
    parser.add_argument("--mode", nargs="+", choices=["eager", "compile"],
                        default=["eager", "compile"], help="default: %(default)s")
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16", "fp16"], default=["fp32"],
                        help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-data", action="store_true",
                        help="read the data set, print one JSON line about it and exit "
                             "(needs no PyTorch)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.warmup < 2:
        # The first step compiles and the second often recompiles (the
        # optimizer's momentum buffers appear): neither may be timed.
        parser.error(f"--warmup {args.warmup} must be at least 2")
    for batch in args.batch:
        if batch < 1:
            parser.error(f"--batch {batch} must be at least 1")
    return args


def idx_path(folder, stem):
    """The .gz file Debian ships, or the unpacked file (as loom accepts both); None if neither."""
    for name in (stem + ".gz", stem):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def read_idx(path, magic):
    """(dimensions, raw bytes) of an IDX file of unsigned bytes; raises ValueError if malformed."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as file:
        raw = file.read()
    if len(raw) < 4 or struct.unpack(">I", raw[:4])[0] != magic:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {magic:#010x} expected)")
    rank = magic & 0xFF
    header = 4 + 4 * rank
    dims = struct.unpack(f">{rank}I", raw[4:header])
    count = 1
    for dim in dims:
        count *= dim
    if len(raw) - header != count:
        raise ValueError(f"{path}: {len(raw) - header} bytes of data, {count} expected "
                         f"for dimensions {dims} (a cut-short file?)")
    return dims, raw[header:]


def load_training_set(folder):
    """(images bytes, labels bytes, count) of the training split, or None when its files are missing."""
    images_path = idx_path(folder, "train-images-idx3-ubyte")
    labels_path = idx_path(folder, "train-labels-idx1-ubyte")
    if images_path is None or labels_path is None:
        return None
    image_dims, images = read_idx(images_path, IDX_IMAGES)
    (label_count,), labels = read_idx(labels_path, IDX_LABELS)
    if image_dims[1:] != (28, 28) or image_dims[0] != label_count:
        raise ValueError(f"{folder}: {image_dims} images and {label_count} labels; "
                         f"expected N 28x28 images and N labels")
    if max(labels) > 9:
        raise ValueError(f"{labels_path}: label {max(labels)} is not a class 0..9")
    return images, labels, label_count


def emit(line):
    print(json.dumps(line, sort_keys=True, separators=(",", ":")), flush=True)


def cpu_step_ms(step, images, labels, batch, warmup, steps):
    """Median time of step(x, y) on the CPU, in ms, as loom's median_step_ms
    (benchmarks/lenet_bench.hpp) takes it: consecutive real batches, never the
    same memory twice in a row, each step on the host's clock, the upper middle
    of the timed ones after `warmup` untimed."""
    batches = images.shape[0] // batch
    times = []
    for s in range(warmup + steps):
        first = (s % batches) * batch
        x, y = images[first:first + batch], labels[first:first + batch]
        start = time.perf_counter()
        step(x, y)
        if s >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    return sorted(times)[len(times) // 2]


def fp32_without_tf32(torch):
    """Turns TF32 off for cuBLAS and cuDNN. PyTorch 2.9+ has per-backend
    fp32_precision settings and raises when they disagree with the legacy
    allow_tf32 flags, so only one of the two APIs is used."""
    backends = torch.backends
    if hasattr(backends, "fp32_precision"):
        backends.fp32_precision = "ieee"
        backends.cuda.matmul.fp32_precision = "ieee"
        backends.cudnn.fp32_precision = "ieee"
        # The global setting does not reach these (pytorch/pytorch#179445).
        backends.cudnn.conv.fp32_precision = "ieee"
        backends.cudnn.rnn.fp32_precision = "ieee"
        return (backends.cuda.matmul.fp32_precision == "ieee"
                and backends.cudnn.conv.fp32_precision == "ieee")
    backends.cuda.matmul.allow_tf32 = False
    backends.cudnn.allow_tf32 = False
    return not backends.cuda.matmul.allow_tf32 and not backends.cudnn.allow_tf32


def lenet(nn):
    return nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(800, 500), nn.ReLU(),
        nn.Linear(500, 10))


def make_step(torch, model, optimizer, mode, precision):
    """One training step: forward, cross-entropy, backward, SGD update."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def forward_loss(x, y):
        if dtype is not None:
            with torch.autocast("cuda", dtype=dtype):
                return torch.nn.functional.cross_entropy(model(x), y)
        return torch.nn.functional.cross_entropy(model(x), y)

    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def update():
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    if mode == "compile":
        # Static shapes: one graph per batch size, as a fixed-size loom Model is.
        forward_loss = torch.compile(forward_loss, dynamic=False)
        # GradScaler's step reads its overflow flag on the host: left eager.
        if scaler is None:
            update = torch.compile(update, dynamic=False)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss(x, y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        update()

    return step


def measure(torch, images, labels, batch, mode, precision, args, device_name, data_kind):
    torch.manual_seed(args.seed)
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # no graphs or dynamic-shape decisions from another batch size
    model = lenet(torch.nn).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = make_step(torch, model, optimizer, mode, precision)
    batches = images.shape[0] // batch

    def run(s):
        # Consecutive batches, never the same memory twice in a row (as loom's benchmark).
        first = (s % batches) * batch
        return images[first:first + batch], labels[first:first + batch]

    start = time.perf_counter()
    for s in range(args.warmup):
        step(*run(s))
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
    for i in range(args.steps):
        x, y = run(args.warmup + i)
        starts[i].record()
        step(x, y)
        stops[i].record()
    torch.cuda.synchronize()
    median = statistics.median(a.elapsed_time(b) for a, b in zip(starts, stops))
    # First start to last stop: the gaps between steps (batch slicing, Python)
    # included, which the per-step median leaves out.
    mean = starts[0].elapsed_time(stops[-1]) / args.steps
    emit({
        "benchmark": "lenet_train_step" + ("" if precision == "fp32" else "_" + precision),
        "library": f"pytorch-{mode}",
        "backend": "cuda",
        "batch": batch,
        "steps": args.steps,
        "median_step_ms": median,
        "mean_step_ms": mean,
        "images_per_s": 1000.0 * batch / median,
        "gflop_per_s": batch * FLOPS_PER_SAMPLE / median / 1e6,
        "warmup_s": warmup_s,
        "data": data_kind,
        "device": device_name,
        "precision": precision,
        "torch": torch.__version__,
    })


def main(argv):
    args = parse_args(argv)
    try:
        train = load_training_set(args.data)
    except (OSError, EOFError, ValueError) as error:
        print(f"lenet.py: cannot read Fashion-MNIST from {args.data}: {error}", file=sys.stderr)
        return 1
    data_kind = "fashion-mnist" if train else "random"
    if train is None:
        print(f"lenet.py: no Fashion-MNIST training files in {args.data}; timing on random data "
              f"(\"data\":\"random\" in every line)", file=sys.stderr)
    count = train[2] if train else 60_000
    for batch in args.batch:
        if batch > count:
            print(f"lenet.py: --batch {batch} must be between 1 and the {count} training samples",
                  file=sys.stderr)
            return 1
    if args.check_data:
        line = {"data": data_kind, "samples": count, "folder": args.data}
        if train:
            line["first_labels"] = list(train[1][:10])
            line["mean_pixel"] = sum(train[0]) / len(train[0]) / 255.0
        emit(line)
        return 0

    try:
        import torch
    except ImportError as error:
        print(f"lenet.py: PyTorch is needed to time the steps ({error}); run it with the python3 "
              f"that has torch, or use --check-data to test the data reading alone",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(f"lenet.py: PyTorch {torch.__version__} sees no CUDA GPU", file=sys.stderr)
        return 1
    if not fp32_without_tf32(torch):
        print("lenet.py: could not turn TF32 off", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    if sum(p.numel() for p in lenet(torch.nn).parameters()) != PARAMETERS:
        print(f"lenet.py: the network is not loom's LeNet ({PARAMETERS} parameters)", file=sys.stderr)
        return 1

    if train:
        images_bytes, labels_bytes, _ = train
        images = torch.frombuffer(bytearray(images_bytes), dtype=torch.uint8)
        images = images.view(count, 1, 28, 28).to(device).float().div_(255.0)
        images = images.sub_(MEAN).div_(STD)
        labels = torch.frombuffer(bytearray(labels_bytes), dtype=torch.uint8).to(device).long()
    else:
        generator = torch.Generator(device=device).manual_seed(args.seed)
        images = torch.randn(count, 1, 28, 28, device=device, generator=generator)
        labels = torch.randint(0, 10, (count,), device=device, generator=generator)
    device_name = torch.cuda.get_device_name(device)

    for precision in args.precision:
        for mode in args.mode:
            for batch in args.batch:
                measure(torch, images, labels, batch, mode, precision, args, device_name,
                        data_kind)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
