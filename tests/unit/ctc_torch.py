#!/usr/bin/env python3
"""ctc_torch.py CHECKER WORK_FILE: PyTorch's CTC loss as the reference for loom's.

Writes fixed inputs (float32 logits N x T x C, padded targets, frame and
target lengths) with torch.nn.functional.ctc_loss(log_softmax(x),
reduction='mean') and its gradient with respect to x, computed in float32 and
in float64, into WORK_FILE, then runs CHECKER (ctc_torch_check) on it, which
computes loom's cpu::ctc_loss<float> and compares. Exit status: the checker's (0 agree, 1 differ), 77 (CTest's
skip) when torch cannot be imported, 2 for a wrong command line.
"""
import subprocess
import sys

SKIP = 77


def cases(torch):
    # (seed, frames, targets, classes, zero_infinity): connected digits are
    # 11 words (oh, zero..nine) and the blank; targets with repeats ("7 7 7"),
    # frames near their limits, a sample of one frame, and under
    # zero_infinity one sample too short for its target (3 labels, 2 repeats,
    # 4 frames).
    yield (1, [50, 31, 12, 44, 3, 50], [[1, 2, 3, 4, 5, 6, 7], [7, 7, 7], [11, 11, 3, 3, 4, 4],
                                       [2, 9, 4, 11, 10], [5, 6], [8, 8, 8, 8, 8, 8, 8]],
           12, False)
    yield (2, [20, 4, 1, 17], [[3, 1, 3], [1, 1, 1], [2], [4, 4, 1, 4]], 6, True)


def write_case(out, torch, seed, frames, targets, classes, zero_infinity):
    n, max_frames = len(frames), max(frames)
    max_target = max(len(t) for t in targets)
    gen = torch.Generator().manual_seed(seed)
    # Scores spread like a trained network's (confident frames), not N(0, 1).
    x32 = 4.0 * torch.randn(n, max_frames, classes, generator=gen)
    padded = torch.zeros(n, max_target, dtype=torch.long)
    for i, t in enumerate(targets):
        padded[i, : len(t)] = torch.tensor(t)
    input_lengths = torch.tensor(frames, dtype=torch.long)
    target_lengths = torch.tensor([len(t) for t in targets], dtype=torch.long)

    # float32, as loom's op is used, and float64 on the same values: torch's
    # own float32 rounding is most of the float32 difference (loom's
    # recursions run in double).
    def torch_ctc(dtype):
        x = x32.to(dtype).detach().clone().requires_grad_()
        log_probs = torch.log_softmax(x, dim=2).transpose(0, 1)  # T x N x C, as torch wants
        loss = torch.nn.functional.ctc_loss(log_probs, padded, input_lengths, target_lengths,
                                            blank=0, reduction='mean',
                                            zero_infinity=zero_infinity)
        loss.backward()
        return loss.item(), x.grad.flatten().tolist()

    def line(values, fmt):
        out.write(' '.join(fmt % v for v in values) + '\n')

    line([n, max_frames, classes, max_target, int(zero_infinity)], '%d')
    line(frames, '%d')
    line(target_lengths.tolist(), '%d')
    line(padded.flatten().tolist(), '%d')
    line(x32.flatten().tolist(), '%.9g')  # float32 round-trips in 9 digits
    for dtype in (torch.float32, torch.float64):
        loss, grad = torch_ctc(dtype)
        line([loss], '%.17g')
        line(grad, '%.17g')


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    checker, work_file = sys.argv[1], sys.argv[2]
    try:
        import torch
    except ImportError as error:
        print(f'skipped: torch cannot be imported ({error}); install python3-torch', file=sys.stderr)
        return SKIP
    all_cases = list(cases(torch))
    with open(work_file, 'w') as out:
        out.write(f'{len(all_cases)}\n')
        for case in all_cases:
            write_case(out, torch, *case)
    print(f'torch {torch.__version__}: {len(all_cases)} cases written to {work_file}')
    sys.stdout.flush()
    return subprocess.run([checker, work_file]).returncode


if __name__ == '__main__':
    sys.exit(main())
