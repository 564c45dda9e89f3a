"""Tests of scripts/plot_metrics.py, run by CTest with the interpreter that
should draw (Debian's python3, where python3-matplotlib installs).

    check_plot.py png PLOT_SCRIPT METRICS OUT.png
        draws METRICS (export_lenet's metrics.jsonl) and checks that OUT.png
        is a PNG of more than 10 kB; 77 (CTest's skip) without matplotlib
    check_plot.py bad-input PLOT_SCRIPT SCRATCH_DIR
        a missing file, a line that is not JSON and a file without step
        lines each exit with 2 and a message naming what is wrong
"""

import subprocess
import sys
from pathlib import Path

SKIP = 77
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# export_lenet's 32 steps draw 83 kB; an empty figure of that size is 5 kB.
# (Only the drawing shows the data: without its loss lines it is still 44 kB.)
MIN_PNG_BYTES = 10_000


def run(script, *args):
    return subprocess.run([sys.executable, str(script), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def check(condition, message):
    if not condition:
        print(f"FAIL: {message}", file=sys.stderr)
        sys.exit(1)


def check_png(script, metrics, out):
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        print(f"skipped: {sys.executable} cannot import matplotlib ({error}); "
              "install python3-matplotlib", file=sys.stderr)
        return SKIP
    out.unlink(missing_ok=True)
    result = run(script, metrics, "-o", out)
    print(result.stdout + result.stderr, end="")
    check(result.returncode == 0, f"plot_metrics.py exited with {result.returncode}")
    check(out.is_file(), f"{out} was not written")
    data = out.read_bytes()
    check(data.startswith(PNG_SIGNATURE), f"{out} does not start with the PNG signature")
    check(len(data) > MIN_PNG_BYTES, f"{out} has {len(data)} bytes, not more than {MIN_PNG_BYTES}")
    print(f"{out}: PNG, {len(data)} bytes")
    return 0


def expect_read_error(script, path, *expected):
    result = run(script, path, "-o", path.with_suffix(".png"))
    check(result.returncode == 2,
          f"plot_metrics.py on {path.name} exited with {result.returncode}, expected 2; "
          f"stderr: {result.stderr!r}")
    for text in expected:
        check(text in result.stderr, f"plot_metrics.py on {path.name}: {text!r} is not in "
                                     f"its message {result.stderr!r}")
    check(not path.with_suffix(".png").exists(), f"a PNG was written for {path.name}")
    print(f"{path.name}: exit 2, {result.stderr.strip()}")


def check_bad_input(script, scratch):
    scratch.mkdir(parents=True, exist_ok=True)
    step = '{"kind":"step","step":%d,"epoch":1,"epoch_step":%d,"loss":2.0,"accuracy":0.1,' \
           '"lr":0.01}\n'

    missing = scratch / "missing.jsonl"
    missing.unlink(missing_ok=True)
    expect_read_error(script, missing, f"cannot read '{missing}'")

    # Line 3 is cut short mid-object, with lines after it: damage, not the
    # unfinished last line of a crash.
    corrupt = scratch / "corrupt.jsonl"
    corrupt.write_text(step % (1, 1) + step % (2, 2) + '{"kind":"step","step":3,"lo\n'
                       + step % (4, 4))
    expect_read_error(script, corrupt, f"{corrupt}:3: not a JSON line")

    no_steps = scratch / "no_steps.jsonl"
    no_steps.write_text('{"kind":"epoch","step":0,"epoch":1,"loss":1,"accuracy":0.5}\n')
    expect_read_error(script, no_steps, 'has no "step" lines')
    return 0


def main(argv):
    if len(argv) == 5 and argv[1] == "png":
        return check_png(Path(argv[2]), Path(argv[3]), Path(argv[4]))
    if len(argv) == 4 and argv[1] == "bad-input":
        return check_bad_input(Path(argv[2]), Path(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
