#!/usr/bin/env python3
"""recurrent_torch.py CHECKER WORK_DIR: PyTorch's nn.GRU / nn.LSTM as the reference for loom's.

CHECKER (recurrent_torch_check) writes the cases into WORK_DIR/cases.txt:
each layer (GRU or LSTM, one or two directions, every step's output or the
last state), its lengths, input, loss weights r and loom's initial
parameters under loom's tensor names. This script loads those parameters
into nn.GRU / nn.LSTM (batch_first=True) by name (strictly: the names must be
PyTorch's), runs them in float64 over pack_padded_sequence with the same
lengths (pad_packed_sequence back to every step, zeros in the padding),
takes loss = sum(output * r) and writes the output and the gradients of the
input and of every parameter into WORK_DIR/torch.txt. Then it runs CHECKER,
which computes loom's in float and double and compares.

For a layer that outputs its last state (sequence 0), the output is h_n,
both directions side by side, checked here to equal output[len - 1, :H] and
output[0, H:] of the same layer's every-step output.

Exit status: the checker's (0 agree, 1 differ), 77 (CTest's skip) when torch
cannot be imported, 2 for a wrong command line or a malformed cases file.
"""
import os
import subprocess
import sys

SKIP = 77


def read_cases(path):
    with open(path) as f:
        tokens = f.read().split('\n')
    lines = iter(tokens)

    def ints():
        return [int(v) for v in next(lines).split()]

    def floats():
        return [float(v) for v in next(lines).split()]

    count = ints()[0]
    for _ in range(count):
        head = next(lines).split()
        kind = head[0]
        sequence, bidirectional, hidden, features, steps, batch, has_lengths = map(int, head[1:])
        lengths = ints()
        x = floats()
        r = floats()
        tensors = []
        for _ in range(ints()[0]):
            spec = next(lines).split()
            name, rank = spec[0], int(spec[1])
            shape = [int(d) for d in spec[2:2 + rank]]
            tensors.append((name, shape, floats()))
        yield dict(kind=kind, sequence=bool(sequence), bidirectional=bool(bidirectional),
                   hidden=hidden, features=features, steps=steps, batch=batch,
                   has_lengths=bool(has_lengths), lengths=lengths, x=x, r=r, tensors=tensors)


def torch_case(torch, case, out):
    nn = torch.nn
    dtype = torch.float64
    n, steps, hidden = case['batch'], case['steps'], case['hidden']
    directions = 2 if case['bidirectional'] else 1
    make = nn.GRU if case['kind'] == 'gru' else nn.LSTM
    module = make(input_size=case['features'], hidden_size=hidden, batch_first=True,
                  bidirectional=case['bidirectional']).to(dtype)
    # The files hold float32 values in 9 digits: rounded to float32 first,
    # they are loom's values exactly (the nearest double to 9 digits is not).
    def exact(values):
        return torch.tensor(values, dtype=torch.float32).to(dtype)

    state = {name: exact(values).view(shape) for name, shape, values in case['tensors']}
    module.load_state_dict(state, strict=True)

    x = exact(case['x']).view(n, steps, case['features']).requires_grad_()
    lengths = torch.tensor(case['lengths'], dtype=torch.long)
    if case['has_lengths']:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        packed_out, h = module(packed)
        every, _ = nn.utils.rnn.pad_packed_sequence(packed_out, batch_first=True,
                                                    total_length=steps)
    else:
        every, h = module(x)
    h_n = h if case['kind'] == 'gru' else h[0]  # directions x n x H
    last = h_n.permute(1, 0, 2).reshape(n, directions * hidden)
    # h_n is output[len - 1, :H] and, reversed, output[0, H:].
    for s in range(n):
        length = int(lengths[s])
        expected = every[s, length - 1, :hidden]
        if directions == 2:
            expected = torch.cat([expected, every[s, 0, hidden:]])
        if not torch.equal(last[s], expected):
            raise SystemExit(f"torch's h_n is not output[len-1, :H], output[0, H:] for sample {s}")
    y = every if case['sequence'] else last
    r = exact(case['r']).view(y.shape)
    (y * r).sum().backward()

    def line(t):
        out.write(' '.join('%.17g' % v for v in t.detach().flatten().tolist()) + '\n')

    line(y)
    line(x.grad)
    parameters = dict(module.named_parameters())
    for name, _, _ in case['tensors']:
        line(parameters[name].grad)


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    checker, work_dir = sys.argv[1], sys.argv[2]
    try:
        import torch
    except ImportError as error:
        print(f'skipped: torch cannot be imported ({error}); install python3-torch', file=sys.stderr)
        return SKIP
    os.makedirs(work_dir, exist_ok=True)
    cases_file = os.path.join(work_dir, 'cases.txt')
    torch_file = os.path.join(work_dir, 'torch.txt')
    written = subprocess.run([checker, 'write', cases_file]).returncode
    if written != 0:
        return written
    cases = list(read_cases(cases_file))
    with open(torch_file, 'w') as out:
        for case in cases:
            torch_case(torch, case, out)
    print(f'torch {torch.__version__}: {len(cases)} cases, float64, written to {torch_file}')
    sys.stdout.flush()
    return subprocess.run([checker, 'compare', cases_file, torch_file]).returncode


if __name__ == '__main__':
    sys.exit(main())
