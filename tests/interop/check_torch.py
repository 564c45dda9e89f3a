"""The PyTorch side of the interoperability test: loads a loom LeNet checkpoint
with the safetensors package into the equivalent torch.nn.Sequential and
checks that it gives loom's logits on the reference images.

    check_torch.py CHECKPOINT REFERENCE

CHECKPOINT and REFERENCE come from export_lenet. Exit status: 0 when the
logits match, 1 when they do not (or the checkpoint does not fit the model),
77 (CTest's skip) when torch or safetensors cannot be imported.
"""

import re
import sys

SKIP = 77
# float32 logits of magnitude ~10 summed in another order (im2col + OpenBLAS
# against PyTorch's convolution): differences of a few 1e-6 are rounding, a
# wrong layout or offset gives differences of order 1.
TOLERANCE = 1e-4

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as error:
    print(f"skipped: cannot import the Python side ({error}); install python3-torch "
          "(Debian) or torch, and safetensors (pip)", file=sys.stderr)
    sys.exit(SKIP)


def lenet():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 20, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(20, 50, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(800, 500), torch.nn.ReLU(),
        torch.nn.Linear(500, 10))


# loom's layer kinds and the torch modules they become.
KINDS = {"conv": torch.nn.Conv2d, "linear": torch.nn.Linear}


def fail(message):
    print(f"MISMATCH: {message}", file=sys.stderr)
    sys.exit(1)


def torch_state(tensors, model):
    """loom's "I.kind.name" (layer I counted from 1, Input being 0) becomes
    torch's "<I-1>.name"; the optimizer's tensors are checked and left out."""
    state, optimizer = {}, {}
    for name, tensor in tensors.items():
        if name.startswith("optimizer."):
            optimizer[name] = tensor
            continue
        match = re.fullmatch(r"(\d+)\.(\w+)\.(\w+)", name)
        if match is None:
            fail(f"checkpoint tensor '{name}' is not named <layer>.<kind>.<name>")
        index, kind, field = int(match[1]) - 1, match[2], match[3]
        if not 0 <= index < len(model) or not isinstance(model[index], KINDS.get(kind, ())):
            fail(f"checkpoint tensor '{name}': torch layer {index} is "
                 f"{type(model[index]).__name__ if 0 <= index < len(model) else 'missing'}, "
                 f"not loom's '{kind}'")
        if tensor.dtype != torch.float32:
            fail(f"checkpoint tensor '{name}' is {tensor.dtype}, expected torch.float32")
        state[f"{index}.{field}"] = tensor
    expected = {f"optimizer.momentum_buffer.{name}" for name in tensors
                if not name.startswith("optimizer.")}
    if set(optimizer) != expected:
        fail(f"optimizer tensors missing: {sorted(expected - set(optimizer))}, unexpected: "
             f"{sorted(set(optimizer) - expected)} (SGD with momentum keeps one "
             "momentum_buffer per parameter)")
    for name, tensor in optimizer.items():
        weights = tensors[name[len("optimizer.momentum_buffer."):]]
        if tensor.shape != weights.shape:
            fail(f"'{name}' has shape {list(tensor.shape)}, its parameter {list(weights.shape)}")
    return state


def main(argv):
    if len(argv) != 3:
        print(f"usage: {argv[0]} CHECKPOINT REFERENCE", file=sys.stderr)
        return 2
    checkpoint, reference_path = argv[1], argv[2]
    with safe_open(checkpoint, framework="pt") as file:
        metadata = file.metadata() or {}
    if metadata.get("format") != "loom.checkpoint.1":
        fail(f"'{checkpoint}' has format {metadata.get('format')!r}, not 'loom.checkpoint.1'")

    model = lenet()
    try:
        model.load_state_dict(torch_state(load_file(checkpoint), model), strict=True)
    except RuntimeError as error:
        fail(f"'{checkpoint}' does not fit torch's LeNet: {error}")
    model.eval()

    reference = load_file(reference_path)
    images, expected = reference["images"], reference["logits"]
    if images.dtype != torch.float32 or images.shape != (100, 1, 28, 28):
        fail(f"reference images are {images.dtype} {list(images.shape)}, "
             "expected torch.float32 [100, 1, 28, 28]")
    with torch.no_grad():
        logits = model(images)
    if logits.shape != expected.shape:
        fail(f"torch gives logits {list(logits.shape)}, loom {list(expected.shape)}")

    difference = (logits - expected).abs().max().item()
    agree = int((logits.argmax(dim=1) == expected.argmax(dim=1)).sum())
    print(f"loom checkpoint '{checkpoint}' ({metadata.get('trainer.steps')} steps) in "
          f"torch {torch.__version__}: max |torch - loom| over {len(images)} x "
          f"{expected.shape[1]} logits = {difference:.3e} (tolerance {TOLERANCE:g}); "
          f"argmax agrees on {agree}/{len(images)}")
    if not difference < TOLERANCE:
        fail(f"max abs difference {difference:.3e} is not below {TOLERANCE:g}")
    if agree != len(images):
        fail(f"the predicted class differs on {len(images) - agree} of {len(images)} images")
    print("match")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
