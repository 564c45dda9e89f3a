#!/usr/bin/env python3
"""The LeNet example stopped and guarded as a user's job would be.

  run_control.py SCENARIO --program LENET --data DIR --work DIR [--mpirun MPIRUN]

SCENARIO:
  term         SIGTERM mid-epoch: exit 143, the checkpoint saved at the step it
               stopped after, and the printed command resumes from there.
  startup      SIGTERM while the data are read: exit 143, stopped before the
               first step, the checkpoint saved.
  mpirun_usr1  mpirun -np 2, SIGUSR1 to rank 1 only: both processes stop at one
               step, exit 138, and the printed mpirun command resumes.
  lock         a second run saving to the same checkpoint is refused at once,
               naming the first run's process id; the first goes on.
  nothing_left a resume whose checkpoint already finished --epochs says so and
               trains nothing.
Exits 0 when every check holds, else 1 with what differed.
"""
import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time


def fail(why, output=""):
    print(f"FAILED: {why}")
    if output:
        print("---- output ----\n" + output)
    sys.exit(1)


def start(command, **kwargs):
    print("$ " + " ".join(shlex.quote(c) for c in command), flush=True)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)


def read_until(process, pattern, seen, limit=300):
    """Reads the process's lines into `seen` until one matches `pattern`."""
    began = time.monotonic()
    for line in process.stdout:
        seen.append(line)
        if re.search(pattern, line):
            return line
        if time.monotonic() - began > limit:
            break
    fail(f"no line matched {pattern!r}", "".join(seen))


def finish(process, seen, limit=300):
    try:
        rest, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.kill()
        fail("the process did not end", "".join(seen))
    seen.append(rest)
    return "".join(seen)


def expect(text, pattern, output):
    found = re.search(pattern, text)
    if not found:
        fail(f"expected {pattern!r}", output)
    return found


def catches(pid, number):
    """Whether process `pid` has a handler for signal `number` (/proc's SigCgt)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16) & (1 << (number - 1)) != 0
    return False


def run(command, limit=300):
    print("$ " + " ".join(shlex.quote(c) for c in command), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=limit)
    return done.returncode, done.stdout


def check_resume(command, checkpoint, step, output):
    """Runs the printed resume command; it must go on after `step`."""
    status, resumed = run(shlex.split(command))
    if status != 0:
        fail(f"the resume command ended with {status}", resumed)
    expect(resumed, rf"resuming {re.escape(checkpoint)} after step {step} \(epoch 1\)", resumed)
    expect(resumed, r"final test accuracy: \d+\.\d\d%", resumed)
    print(resumed)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--program", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--mpirun")
    a = parser.parse_args()
    os.makedirs(a.work, exist_ok=True)
    checkpoint = os.path.join(a.work, f"{a.scenario}.safetensors")
    for leftover in (checkpoint, checkpoint + ".lock"):
        if os.path.exists(leftover):
            os.remove(leftover)
    # 10000 images: 157 steps an epoch, a progress line every 15 steps; a
    # signal sent at the first line lands with over 140 steps to go.
    common = ["--train-samples", "10000", "--test-samples", "1000", "--data", a.data,
              "--checkpoint", checkpoint]
    seen = []

    if a.scenario == "term":
        # One epoch: the resume need only finish the epoch the signal cut
        # short (a second one took 10 s of CI's time and checked nothing more).
        p = start([a.program, "--epochs", "1", *common])
        read_until(p, r"^epoch 1/1 step \d+/157", seen)
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        output = finish(p, seen)
        took = time.monotonic() - sent
        if p.returncode != 143:
            fail(f"exit status {p.returncode}, expected 143 (128 + SIGTERM)", output)
        step = expect(output, r"SIGTERM: stopping after step (\d+); a second signal ends the "
                      r"program at once\n", output).group(1)
        expect(output, rf"checkpoint {re.escape(checkpoint)} \(step {step}\) in [0-9.]+ s\n", output)
        expect(output, rf"stopped by SIGTERM after step {step} \(epoch 1, step {step}\)\n", output)
        command = expect(output, r"resume with: (.*)\n", output).group(1)
        if "final test accuracy" in output or "epoch 1/1 done" in output:
            fail("the run went on after the signal", output)
        print(output)
        print(f"signal to exit: {took:.3f} s")
        check_resume(command, checkpoint, step, output)
    elif a.scenario == "startup":
        p = start([a.program, "--epochs", "1", *common])
        # As soon as the handler is there (the kernel shows it caught), while
        # the data are read (about a second).
        began = time.monotonic()
        while not catches(p.pid, signal.SIGTERM):
            if p.poll() is not None or time.monotonic() - began > 30:
                fail("the program never installed its handler", finish(p, seen))
            time.sleep(0.001)
        p.send_signal(signal.SIGTERM)
        output = finish(p, seen)
        if p.returncode != 143:
            fail(f"exit status {p.returncode}, expected 143", output)
        expect(output, r"SIGTERM: stopping before the fit's first step;.*\ncheckpoint .* \(step 0\) "
               r"in [0-9.]+ s\nstopped by SIGTERM before the first step\n", output)
        if re.search(r"^epoch 1/1 step", output, re.M):
            fail("it trained", output)
        if not os.path.exists(checkpoint):
            fail("no checkpoint was saved", output)
        print(output)
    elif a.scenario == "mpirun_usr1":
        p = start([a.mpirun, "-np", "2", "--oversubscribe", a.program, "--epochs", "1", *common])
        read_until(p, r"^epoch 1/1 step \d+/157", seen)
        # Rank 1 alone: the two processes must agree to stop at one step.
        ranks = {}
        for child in subprocess.run(["pgrep", "-P", str(p.pid)], stdout=subprocess.PIPE,
                                    text=True).stdout.split():
            with open(f"/proc/{child}/environ", "rb") as env:
                for entry in env.read().split(b"\0"):
                    if entry.startswith(b"OMPI_COMM_WORLD_RANK="):
                        ranks[int(entry.split(b"=")[1])] = int(child)
        if 1 not in ranks:
            fail(f"rank 1's process not found among mpirun's children ({ranks})", "".join(seen))
        os.kill(ranks[1], signal.SIGUSR1)
        output = finish(p, seen)
        if p.returncode != 138:
            fail(f"mpirun's exit status {p.returncode}, expected 138 (128 + SIGUSR1)", output)
        step = expect(output, r"SIGUSR1: stopping after step (\d+) on every process", output).group(1)
        expect(output, rf"stopped by SIGUSR1 after step {step} \(epoch 1, step {step}\)", output)
        command = expect(output, r"resume with: (mpirun -np 2 .*)\n", output).group(1)
        print(output)
        check_resume(command, checkpoint, step, output)
    elif a.scenario == "lock":
        first = start([a.program, "--epochs", "2", *common])
        read_until(first, r"^epoch 1/2 step \d+/157", seen)
        status, second = run([a.program, "--epochs", "1", *common], limit=120)
        print(second)
        if status != 1:
            first.kill()
            fail(f"the second run ended with {status}, expected 1", second)
        expect(second, rf"loom: callbacks::Checkpoint: '{re.escape(checkpoint)}' is being written "
               rf"by process {first.pid}, which holds '{re.escape(checkpoint)}\.lock'", second)
        if "training:" in second:
            first.kill()
            fail("the second run trained before it was refused", second)
        first.send_signal(signal.SIGTERM)
        output = finish(first, seen)
        if first.returncode != 143:
            fail(f"the first run ended with {first.returncode}, expected 143", output)
        if os.path.exists(checkpoint + ".lock"):
            fail("the lock file outlived its run", output)
    elif a.scenario == "nothing_left":
        short = ["--train-samples", "2000", "--test-samples", "500", "--data", a.data]
        status, output = run([a.program, "--epochs", "1", *short, "--checkpoint", checkpoint])
        if status != 0:
            fail(f"the first run ended with {status}", output)
        status, output = run([a.program, "--epochs", "1", *short, "--resume", checkpoint])
        print(output)
        if status != 0:
            fail(f"the resume ended with {status}", output)
        expect(output, r"the checkpoint already finished epoch 1 of 1; pass --epochs 2 to train "
               r"on\nthe checkpoint's test accuracy: [1-9]\d\.\d\d% \(loss \d\.\d+\)\n", output)
        for trained in ("training:", "epoch(s) of", "final test accuracy"):
            if trained in output:
                fail(f"'{trained}' printed: it trained, or reported a run it did not make", output)
    else:
        fail(f"unknown scenario {a.scenario}")
    print(f"{a.scenario}: passed")


if __name__ == "__main__":
    main()
