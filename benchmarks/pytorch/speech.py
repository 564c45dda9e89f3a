#!/usr/bin/env python3
"""PyTorch peer of loom's speech_step benchmark (benchmarks/speech_bench.cpp):
the speech example's network in PyTorch on the same batches that
speech_bench --dump wrote (the same log-mel features, lengths and targets),
one training step each (forward, CTC loss with reduction 'mean', backward,
AdamW lr 0.002), the median of --steps after --warmup, with --threads
threads. JSON lines.

The network: Conv1d(80, 128, 5, stride 2, padding 2) over (N, 80, T),
BatchNorm1d(128), ReLU, a 2-layer bidirectional GRU(128, 96) over
pack_padded_sequence (each utterance's frames only, as loom's), Linear(192,
12) per frame, log_softmax, F.ctc_loss (blank 0) over each utterance's
output frames ((frames + 4 - 5) // 2 + 1). PyTorch's BatchNorm has no
lengths: its statistics include the padding (loom's exclude it); the work
is the same.
"""

import argparse
import json
import os
import statistics
import sys
import time



def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", required=True, help="speech_bench --dump's file")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def read_batches(path):
    # Imported only now: Debian's numpy and PyTorch share one OpenBLAS, which
    # sizes its thread pool when it loads, and main() sets
    # OPENBLAS_NUM_THREADS first (imported at the top, numpy gave PyTorch's
    # GEMMs every core whatever --threads said).
    import numpy as np

    with open(path, "rb") as f:
        count, frames, mels, max_target = np.frombuffer(f.read(32), dtype=np.int64)
        per = frames * mels * 4 + 8 + max_target * 4
        raw = f.read()
    if len(raw) != count * per:
        sys.exit(f"speech.py: {path} holds {len(raw)} bytes after its header; expected {count * per}")
    features = np.empty((count, frames, mels), np.float32)
    lengths = np.empty(count, np.int64)
    target_lengths = np.empty(count, np.int64)
    targets = np.empty((count, max_target), np.int64)
    for i in range(count):
        at = i * per
        features[i] = np.frombuffer(raw, np.float32, frames * mels, at).reshape(frames, mels)
        at += frames * mels * 4
        lengths[i], target_lengths[i] = np.frombuffer(raw, np.int32, 2, at)
        at += 8
        targets[i] = np.frombuffer(raw, np.int32, max_target, at)
    return features, lengths, target_lengths, targets


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
        sys.exit("speech.py: PyTorch is missing; install Debian's python3-torch")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    features, lengths, target_lengths, targets = read_batches(args.batches)

    class DigitReader(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(80, 128, 5, stride=2, padding=2)
            self.norm = nn.BatchNorm1d(128)
            self.gru = nn.GRU(128, 96, num_layers=2, bidirectional=True, batch_first=True)
            self.out = nn.Linear(192, 12)

        def forward(self, x, frames):
            y = torch.relu(self.norm(self.conv(x.transpose(1, 2)))).transpose(1, 2)
            packed = nn.utils.rnn.pack_padded_sequence(y, frames, batch_first=True,
                                                       enforce_sorted=False)
            h, _ = self.gru(packed)
            h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=y.shape[1])
            return self.out(h)

    model = DigitReader()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002)
    batches = len(features) // args.batch
    times = []
    for s in range(args.warmup + args.steps):
        first = (s % batches) * args.batch
        part = slice(first, first + args.batch)
        x = torch.from_numpy(features[part])
        out_frames = (torch.from_numpy(lengths[part]) + 4 - 5) // 2 + 1
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(x, out_frames)
        loss = F.ctc_loss(logits.log_softmax(2).transpose(0, 1), torch.from_numpy(targets[part]),
                          out_frames, torch.from_numpy(target_lengths[part]), blank=0,
                          reduction="mean")
        loss.backward()
        optimizer.step()
        if s >= args.warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    times.sort()
    print(json.dumps({"benchmark": "speech_step", "library": "pytorch",
                      "torch": torch.__version__, "network": "DigitReader",
                      "parameters": parameters, "batch": args.batch, "threads": args.threads,
                      "steps": args.steps, "median_step_ms": times[len(times) // 2]},
                     sort_keys=True, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
