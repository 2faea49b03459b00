"""``plot METRICS... -o FILE.png [--title T]``: loss, eval loss and lr against step from train.py's --metrics files,
several runs overlaid (:mod:`plugin.monitor.plot`; matplotlib, the ``[monitor]`` extra)."""
from __future__ import annotations

import json
import sys

from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, cannot_read


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw loss, eval loss and lr against step from --metrics files",
                       description="Plot train.py --metrics JSON lines: loss and eval loss (top) and the learning "
                                   "rate (bottom) against step, one colour per file.")
    p.add_argument("metrics", nargs="+", metavar="METRICS", help="train.py --metrics files (JSON lines)")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the picture to write")
    p.add_argument("--title", default="", help="the picture's title")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..monitor.metrics import read_metrics
    from ..monitor.plot import labels_for, missing, plot_runs

    if missing():
        print(missing(), file=sys.stderr)
        return EXIT_USAGE
    runs = {}
    for label, path in zip(labels_for(args.metrics), args.metrics, strict=True):
        try:
            records = read_metrics(path)
        except OSError as e:
            print(cannot_read(path, e, "a train.py --metrics file (JSON lines)"), file=sys.stderr)
            return EXIT_USAGE
        except json.JSONDecodeError as e:
            print(f"{path}: line {e.lineno}: not a JSON line ({e.msg}) -> pass train.py --metrics files",
                  file=sys.stderr)
            return EXIT_INVALID
        if not any("step" in r and "loss" in r for r in records):
            print(f"{path}: no step/loss records -> pass train.py --metrics files", file=sys.stderr)
            return EXIT_INVALID
        runs[label] = records
    try:
        plot_runs(runs, args.output, args.title)
    except (OSError, ValueError) as e:
        print(f"plot: cannot write {args.output}: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK
