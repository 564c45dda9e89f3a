#!/usr/bin/env python3
"""Draws the JSON lines of loom's callbacks::Metrics as a PNG.

    python3 scripts/plot_metrics.py METRICS.jsonl [-o OUT.png]

Three panels over the optimizer step: the loss (each step's, faint, with its
moving average; each epoch's mean training loss and its test loss as markers
at the epoch's last step), the accuracy (each epoch's training and test
accuracy, over the moving average of the steps'), and the learning rate.
OUT defaults to METRICS with the suffix .png. Needs matplotlib (Debian:
python3-matplotlib); draws without a display.

Exit status: 0 when drawn, 2 when METRICS cannot be read (missing, a line
that is not JSON, no step lines) or the command line is wrong, 1 when the PNG
cannot be written or matplotlib is missing. An unfinished last line (no
newline: a crash cut it short) is left out with a warning.
"""

import argparse
import json
import math
import sys
from collections import deque
from pathlib import Path

READ_ERROR = 2


class ReadError(Exception):
    pass


def number(record, key, where):
    """record[key] as a float; NaN for null (nlohmann writes NaN and
    infinities as null), a ReadError when it is missing or not a number."""
    if key not in record:
        raise ReadError(f"{where}: no \"{key}\" in a \"{record['kind']}\" line")
    value = record[key]
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReadError(f"{where}: \"{key}\" is {json.dumps(value)}, not a number")
    return float(value)


def read_metrics(path):
    """The step and epoch lines, each sorted by step (the trainer's count,
    which goes on over fits, where epochs start again at 1). A resumed run
    (Metrics with append) drops the earlier lines it writes again, but files
    from before it did repeat the steps after the checkpoint: the later line
    of a step wins. Lines of other kinds are left to other readers."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise ReadError(f"cannot read '{path}': {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ReadError(f"'{path}' is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}); is it a metrics file?") from error
    lines = text.split("\n")
    steps, epochs = {}, {}
    for number_in_file, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number_in_file}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number_in_file == len(lines):
                # The last line without its newline: the one a crash cut short.
                print(f"{where}: warning: ignoring the unfinished last line ({error.msg})",
                      file=sys.stderr)
                continue
            raise ReadError(f"{where}: not a JSON line ({error.msg} at column "
                            f"{error.colno}): {line[:80]!r}") from error
        if not isinstance(record, dict) or "kind" not in record:
            raise ReadError(f"{where}: not a metrics line (a JSON object with a \"kind\")")
        if record["kind"] == "step":
            step = number(record, "step", where)
            steps[step] = {
                "step": step,
                "loss": number(record, "loss", where),
                "accuracy": number(record, "accuracy", where),
                "lr": number(record, "lr", where),
            }
        elif record["kind"] == "epoch":
            epoch = {key: number(record, key, where)
                     for key in ("step", "epoch", "loss", "accuracy")}
            for key in ("test_loss", "test_accuracy"):
                epoch[key] = number(record, key, where) if key in record else math.nan
            epochs[epoch["step"]] = epoch
    if not steps:
        raise ReadError(f"'{path}' has no \"step\" lines; is it the file of "
                        "callbacks::Metrics, written after at least one step?")
    return [steps[s] for s in sorted(steps)], [epochs[s] for s in sorted(epochs)]


def moving_average(values, window):
    """The mean of each value and up to window - 1 before it, NaNs skipped."""
    averages, total, count, recent = [], 0.0, 0, deque()
    for value in values:
        recent.append(value)
        if not math.isnan(value):
            total, count = total + value, count + 1
        if len(recent) > window:
            old = recent.popleft()
            if not math.isnan(old):
                total, count = total - old, count - 1
        averages.append(total / count if count else math.nan)
    return averages


def plot(steps, epochs, title, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    # A twentieth of the run, 10 to 200 steps: smooths the step-to-step noise
    # of a small batch and still follows the change within an epoch.
    window = max(min(10, len(steps)), min(200, len(steps) // 20))
    figure, (loss_axes, accuracy_axes, lr_axes) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 8.5), gridspec_kw={"height_ratios": [3, 2, 1]})
    figure.suptitle(title)

    losses = [s["loss"] for s in steps]
    loss_axes.plot(x, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="step loss")
    loss_axes.plot(x, moving_average(losses, window), color="tab:blue", linewidth=1.6,
                   label=f"moving average ({window} steps)")
    epoch_x = [e["step"] for e in epochs]
    if epochs:
        loss_axes.plot(epoch_x, [e["loss"] for e in epochs], "o", color="tab:orange",
                       label="epoch training loss")
        if any(not math.isnan(e["test_loss"]) for e in epochs):
            loss_axes.plot(epoch_x, [e["test_loss"] for e in epochs], "s-", color="tab:red",
                           label="test loss")
    loss_axes.set_ylabel("cross-entropy loss")
    loss_axes.grid(alpha=0.3)
    loss_axes.legend(loc="upper right")

    accuracies = [100.0 * s["accuracy"] for s in steps]
    accuracy_axes.plot(x, moving_average(accuracies, window), color="tab:blue", alpha=0.35,
                       linewidth=1.0, label=f"step accuracy, moving average ({window} steps)")
    if epochs:
        accuracy_axes.plot(epoch_x, [100.0 * e["accuracy"] for e in epochs], "o-",
                           color="tab:orange", label="epoch training accuracy")
        if any(not math.isnan(e["test_accuracy"]) for e in epochs):
            accuracy_axes.plot(epoch_x, [100.0 * e["test_accuracy"] for e in epochs], "s-",
                               color="tab:red", label="test accuracy")
            last = epochs[-1]
            if not math.isnan(last["test_accuracy"]):
                figure.suptitle(f"{title}: test accuracy {100.0 * last['test_accuracy']:.2f} % "
                                f"after epoch {last['epoch']:.0f}")
    accuracy_axes.set_ylabel("accuracy (%)")
    accuracy_axes.grid(alpha=0.3)
    accuracy_axes.legend(loc="lower right")

    lr_axes.plot(x, [s["lr"] for s in steps], color="tab:green")
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("optimizer step")
    lr_axes.grid(alpha=0.3)

    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main(argv):
    parser = argparse.ArgumentParser(
        description="Draw loom's callbacks::Metrics JSON lines (loss, accuracy, learning "
                    "rate over the optimizer step) as a PNG.")
    parser.add_argument("metrics", type=Path, help="the JSON lines file, e.g. metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path,
                        help="the PNG to write (default: METRICS with the suffix .png)")
    args = parser.parse_args(argv[1:])
    out = args.output or args.metrics.with_suffix(".png")

    try:
        steps, epochs = read_metrics(args.metrics)
    except ReadError as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return READ_ERROR
    try:
        import matplotlib  # noqa: F401  (checked before drawing, for the message)
    except ImportError:
        print("plot_metrics: matplotlib is missing; install python3-matplotlib (Debian) or "
              "'pip install matplotlib'", file=sys.stderr)
        return 1
    try:
        plot(steps, epochs, args.metrics.name, out)
    except OSError as error:
        print(f"plot_metrics: cannot write '{out}': {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"wrote {out}: {len(steps)} steps, {len(epochs)} epochs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
