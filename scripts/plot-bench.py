#!/usr/bin/env python3
"""Plot decode tok/s from `pagoda bench --json` output, as SVG.

    pagoda bench --json -p 0 -n 64 -b 1,2,4,8 -d 0,512 > decode.json
    python3 scripts/plot-bench.py decode.json -o decode.svg                 # tok/s against batch
    python3 scripts/plot-bench.py decode.json --x depth -o depth.svg        # tok/s against context
    python3 scripts/plot-bench.py a.json b.json --label before --label after -o ab.svg

One line per input file and per value of the other axis (context depth when x is the batch,
batch when x is the depth); each point is the median of the repetitions, with a bar from the
slowest to the fastest. Only plain decode tests are drawn (`tgN[ @ dD][ xB]`); prefill,
shared-prefix, top-p and verification tests are skipped. Needs matplotlib
(`pip install matplotlib`). The SVG is written without a date, so a rerun on the same JSON
gives the same file.
"""

import argparse
import json
import re
import sys

TEST = re.compile(r"^tg(?P<tokens>\d+)(?: @ d(?P<depth>\d+))?(?: x(?P<batch>\d+))?$")


def decode_points(report):
    """(batch, depth, median, min, max) of every plain decode test in one bench report."""
    points = []
    for result in report["results"]:
        match = TEST.match(result["test"])
        if not match:
            continue
        batch = int(match["batch"] or 1)
        depth = int(match["depth"] or 0)
        points.append((batch, depth, result["median"], result["min"], result["max"]))
    return points


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="`pagoda bench --json` output files")
    parser.add_argument("-o", "--output", required=True, help="the SVG file to write")
    parser.add_argument("--x", choices=["batch", "depth"], default="batch")
    parser.add_argument("--label", action="append", default=[], help="a label per input")
    parser.add_argument("--title", help="default: from the first report's model and device")
    args = parser.parse_args()
    if not args.output.endswith(".svg"):
        sys.exit("--output: only SVG is written; give a file name ending in .svg")
    if args.label and len(args.label) != len(args.inputs):
        sys.exit("--label: give one per input file, or none")

    import matplotlib

    matplotlib.use("svg")
    matplotlib.rcParams["svg.hashsalt"] = "pagoda"
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as <text>: small, searchable files
    import matplotlib.pyplot as plt

    reports = []
    for path in args.inputs:
        with open(path) as file:
            reports.append(json.load(file))
    labels = args.label or [""] * len(reports)
    other = "depth" if args.x == "batch" else "batch"

    figure, axes = plt.subplots(figsize=(8, 5))
    drawn = 0
    for report, label in zip(reports, labels):
        points = decode_points(report)
        for key in sorted({p[0] if other == "batch" else p[1] for p in points}):
            line = sorted(
                (p[1] if args.x == "depth" else p[0], p[2], p[3], p[4])
                for p in points
                if (p[0] if other == "batch" else p[1]) == key
            )
            if not line:
                continue
            xs = [p[0] for p in line]
            medians = [p[1] for p in line]
            below = [p[1] - p[2] for p in line]
            above = [p[3] - p[1] for p in line]
            name = f"{other} {key}" + (f", {label}" if label else "")
            axes.errorbar(xs, medians, yerr=[below, above], marker="o", capsize=3, label=name)
            drawn += 1
    if drawn == 0:
        sys.exit("no plain decode tests (tgN[ @ dD][ xB]) in the input")

    first = reports[0]
    title = args.title or (
        f"pagoda bench: decode tok/s against {args.x}, {first['model']} on {first['device']}"
    )
    axes.set_title(title, fontsize=11)
    axes.set_xlabel("sequences decoding together (batch)" if args.x == "batch" else
                    "tokens already in the KV cache (context depth)")
    axes.set_ylabel("decode tokens per second (median; bar: min to max)")
    axes.set_xscale("log", base=2)
    xs = sorted({p[0] if args.x == "batch" else p[1] for r in reports for p in decode_points(r)})
    if 0 in xs:
        axes.set_xscale("symlog", base=2, linthresh=max(1, min(x for x in xs if x > 0) if any(xs) else 1))
    axes.set_xticks(xs)
    axes.set_xticklabels([str(x) for x in xs])
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.output, metadata={"Date": None})
    print(f"wrote {args.output}: {drawn} line(s)")


if __name__ == "__main__":
    main()
