#!/usr/bin/env python3
"""Plot the `--json` output of pagoda's benches as SVG.

    pagoda bench --json -p 0 -n 64 -b 1,2,4,8 -d 0,512 > decode.json
    python3 scripts/plot-bench.py decode.json -o decode.svg                 # tok/s against batch
    python3 scripts/plot-bench.py decode.json --x depth -o depth.svg        # tok/s against context
    python3 scripts/plot-bench.py a.json b.json --label before --label after -o ab.svg
    llama-bench -p 0 -n 64 -d 0,512 -o json > llama.json   # llama.cpp beside pagoda
    python3 scripts/plot-bench.py decode.json llama.json --x depth --label pagoda --label llama.cpp -o cpu.svg

    pagoda bench attention --json -b 1,4,16,64 -c 1024,4096,16384,32768 > attention.json
    python3 scripts/plot-bench.py attention.json --peer $OUT/decode.json --peer $OUT/decode_tc.json -o attention.svg

    pagoda bench sampling --json > sampling.json          # CPU or --device cuda
    python3 scripts/plot-bench.py sampling.json -o sampling.svg

    SWEEP=0.5,1,2,4 scripts/bench-serve-vs-llamacpp.sh llama-server   # pagoda and llama-server
    python3 scripts/plot-bench.py target/bench-serve-sweep/pagoda-1.json \
        target/bench-serve-sweep/llama-server-1.json -o serve.svg

The kind of report is read from its JSON:
- decode (`pagoda bench --json`): tok/s against batch (or context depth with `--x depth`), one
  line per input file and per value of the other axis; each point is the median of the
  repetitions, with a bar from the slowest to the fastest. Only plain decode tests are drawn
  (`tgN[ @ dD][ xB]`); prefill, shared-prefix, top-p and verification tests are skipped.
  llama.cpp's `llama-bench -o json` output (its `-n N -d D` runs) is read as a decode report,
  so pagoda and llama.cpp can share one plot; files given the same `--label` (alternated
  rounds of one tool) are pooled into one line.
- attention (`pagoda bench attention --json`): GB/s of KV read against the KV cache's size,
  one line per path and batch; `--peer` adds FlashInfer's decode wrappers from the GPU
  anchor kit's `decode.json` (`../shared/anchors/gpu/bench_anchors.py decode`) as dashed
  lines, and the copy rate when the kit measured it.
- sampling, GPU (`pagoda bench sampling --device cuda --json`): microseconds per call against
  batch, one panel per configuration, one line per vocabulary, with FlashInfer's number for the
  same cell (the anchors the bench carries) dashed.
- sampling, CPU (`pagoda bench sampling --json`): microseconds per draw against vocabulary,
  one panel per configuration, the fused sampler and the reference.
- serving sweep (`pagoda bench serve --sweep RATES --json`): TTFT, TPOT and ITL (median and
  p99) against the offered request rate, one colour per input, so two servers swept by
  `scripts/bench-serve-vs-llamacpp.sh` share one picture; the SLOs as dotted lines.

Needs matplotlib (`pip install matplotlib`). The SVG is written without a date, so a rerun
on the same JSON gives the same file.
"""

import argparse
import json
import math
import re
import sys

TEST = re.compile(r"^tg(?P<tokens>\d+)(?: @ d(?P<depth>\d+))?(?: x(?P<batch>\d+))?$")


def from_llama_bench(report):
    """A `llama-bench -o json` report as a decode report: its `tgN` runs (at depth `-d`) with
    every repetition's tok/s; prompt-processing runs are left out."""
    results = [{"test": f"tg{run['n_gen']}"
                        + (f" @ d{run['n_depth']}" if run.get("n_depth") else ""),
                "tokens_per_second": run["samples_ts"]}
               for run in report if run.get("n_gen") and not run.get("n_prompt")]
    first = report[0]
    return {"model": first.get("model_filename", "?"), "device": first.get("cpu_info", "cpu"),
            "results": results}


def pooled(reports, labels):
    """Decode reports that share a label (rounds of one tool alternated with another's) as one
    report: every repetition of a test pooled, then its median, min and max."""
    merged, order = {}, []
    for report, label in zip(reports, labels):
        if label not in merged:
            merged[label] = {**report, "results": []}
            order.append(label)
        tests = {r["test"]: r for r in merged[label]["results"]}
        for result in report["results"]:
            if result["test"] in tests:
                tests[result["test"]]["tokens_per_second"] += result["tokens_per_second"]
            else:
                merged[label]["results"].append(dict(result, tokens_per_second=list(
                    result["tokens_per_second"])))
    for report in merged.values():
        for result in report["results"]:
            samples = sorted(result["tokens_per_second"])
            middle = len(samples) // 2
            result["median"] = (samples[middle] if len(samples) % 2 else
                                (samples[middle - 1] + samples[middle]) / 2)
            result["min"], result["max"] = samples[0], samples[-1]
    return [merged[label] for label in order], order


def kind_of(report):
    """decode, attention, sampling-gpu or sampling-cpu, from the JSON's shape."""
    if isinstance(report, list) and report and "n_gen" in report[0]:
        return "llama-bench"
    if isinstance(report, dict) and "results" in report:
        return "decode"
    if isinstance(report, dict) and "rates" in report:
        return "serve-sweep"
    if isinstance(report, dict) and "cases" in report:
        return "sampling-gpu"
    if isinstance(report, list) and report and "paths" in report[0]:
        return "attention"
    if isinstance(report, list) and report and "fused" in report[0]:
        return "sampling-cpu"
    sys.exit("not a `pagoda bench [attention|sampling] --json` report (or an empty one)")


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


def attention_lines(report, label, paths=None):
    """{name: [(kv_mb, gb_per_s)]}: one line per path (of `paths`, if given) and batch of an
    attention report."""
    lines = {}
    for case in report:
        for path in case["paths"]:
            if paths and path["path"] not in paths:
                continue
            name = f"{path['path']}, B={case['batch']}" + (f", {label}" if label else "")
            lines.setdefault(name, []).append((case["kv_mb"], path["gb_per_s"]))
    return {name: sorted(points) for name, points in lines.items()}


def batch_color(name):
    """One colour per batch size (`..., B=16...`), so each implementation's line of a batch
    shares it and the line style tells the implementations apart."""
    match = re.search(r"B=(\d+)", name)
    batch = int(match[1]) if match else 0
    return f"C{max(batch.bit_length() - 1, 0) // 2 % 10}"


def peer_attention_lines(peer):
    """FlashInfer's decode lines from the anchor kit's decode.json, and the copy rate."""
    lines, copy = {}, None
    for row in peer.get("rows", []):
        if "B" not in row or "kv_bytes" not in row:
            continue
        for impl in ("fi_decode", "fi_decode_tc"):
            rate = row.get(f"{impl}_GBps")
            if rate is not None and not math.isnan(rate):  # a section times one wrapper
                name = f"FlashInfer {impl[3:]}, B={row['B']}"
                lines.setdefault(name, []).append((row["kv_bytes"] / 1e6, row[f"{impl}_GBps"]))
            if f"{impl}_frac_copy" in row and row[f"{impl}_frac_copy"]:
                copy = row[f"{impl}_GBps"] / row[f"{impl}_frac_copy"]
    return {name: sorted(points) for name, points in lines.items()}, copy


def setup_matplotlib():
    import matplotlib

    matplotlib.use("svg")
    matplotlib.rcParams["svg.hashsalt"] = "pagoda"
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as <text>: small, searchable files
    import matplotlib.pyplot as plt

    return plt


def log2_ticks(axes, xs):
    xs = sorted(set(xs))
    if 0 in xs:
        positive = [x for x in xs if x > 0]
        axes.set_xscale("symlog", base=2, linthresh=min(positive) if positive else 1)
    else:
        axes.set_xscale("log", base=2)
    axes.set_xticks(xs)
    axes.set_xticklabels([str(x) for x in xs])


def plot_decode(plt, reports, labels, args):
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
    axes.set_title(args.title or (
        f"pagoda bench: decode tok/s against {args.x}, {first['model']} on {first['device']}"
    ), fontsize=11)
    axes.set_xlabel("sequences decoding together (batch)" if args.x == "batch" else
                    "tokens already in the KV cache (context depth)")
    axes.set_ylabel("decode tokens per second (median; bar: min to max)")
    log2_ticks(axes, [p[0] if args.x == "batch" else p[1]
                      for r in reports for p in decode_points(r)])
    axes.set_ylim(bottom=0)
    return figure, axes, drawn


def plot_attention(plt, reports, labels, args):
    figure, axes = plt.subplots(figsize=(9, 5.5))
    drawn = 0
    for report, label in zip(reports, labels):
        paths = set(args.paths.split(",")) if args.paths else None
        styles = ["-", "-.", ":", (0, (5, 1))]
        for name, points in attention_lines(report, label, paths).items():
            style = styles[sorted(paths or [name.split(",")[0]]).index(name.split(",")[0])
                           % len(styles)] if paths else "-"
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name,
                      color=batch_color(name), linestyle=style)
            drawn += 1
    lines, copy = {}, None
    for peer in args.peer:
        with open(peer) as file:
            more, rate = peer_attention_lines(json.load(file))
        lines.update(more)
        copy = copy or rate
    if lines:
        for name, points in lines.items():
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="x",
                      linestyle="--", label=name, color=batch_color(name),
                      alpha=1.0 if "decode_tc" in name else 0.5)
            drawn += 1
        if copy:
            axes.axhline(copy, color="grey", linestyle=":", label=f"copy rate {copy:.0f} GB/s")
    if drawn == 0:
        sys.exit("no attention cases in the input")
    axes.set_title(args.title or "decode attention: KV bytes read per second against KV size",
                   fontsize=11)
    axes.set_xlabel("KV cache read per call (MB)")
    axes.set_ylabel("GB/s of KV (median of graph replays)")
    axes.set_xscale("log")
    axes.set_ylim(bottom=0)
    return figure, axes, drawn


def plot_sampling_gpu(plt, reports, labels, args):
    cases = [(case, label) for report, label in zip(reports, labels) for case in report["cases"]]
    configurations = sorted({(c["configuration"], c["filtered"]) for c, _ in cases})
    if not configurations:
        sys.exit("no sampling cases in the input")
    columns = min(3, len(configurations))
    rows = -(-len(configurations) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5 * columns, 3.8 * rows), squeeze=False)
    drawn = 0
    for index, (configuration, filtered) in enumerate(configurations):
        axes = grid[index // columns][index % columns]
        chosen = [(c, label) for c, label in cases
                  if c["configuration"] == configuration and c["filtered"] == filtered]
        for vocab in sorted({c["vocab"] for c, _ in chosen}):
            for label in dict.fromkeys(label for _, label in chosen):
                line = sorted((c["batch"], c["median_us"], c.get("anchor")) for c, lb in chosen
                              if c["vocab"] == vocab and lb == label)
                suffix = f", {label}" if label else ""
                axes.plot([p[0] for p in line], [p[1] for p in line], marker="o",
                          label=f"pagoda V={vocab}{suffix}")
                drawn += 1
                peer = [(p[0], p[2]["us"], p[2]["name"]) for p in line if p[2]]
                if peer and label == labels[0]:  # the peer's number is the same in every file
                    axes.plot([p[0] for p in peer], [p[1] for p in peer], marker="x",
                              linestyle="--", label=f"{peer[0][2]} V={vocab}")
        axes.set_title(configuration + (f" ({filtered})" if filtered != "-" else ""), fontsize=10)
        axes.set_xlabel("rows sampled together (batch)")
        axes.set_ylabel("us per call")
        log2_ticks(axes, [c["batch"] for c, _ in chosen])
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    for index in range(len(configurations), rows * columns):
        grid[index // columns][index % columns].axis("off")
    figure.suptitle(args.title or f"GPU sampling, us per call, on {reports[0].get('device', '?')}",
                    fontsize=11)
    return figure, None, drawn


def plot_sampling_cpu(plt, reports, labels, args):
    cases = [(case, label) for report, label in zip(reports, labels) for case in report]
    configurations = list(dict.fromkeys(c["configuration"] for c, _ in cases))
    columns = min(3, len(configurations))
    rows = -(-len(configurations) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5 * columns, 3.8 * rows), squeeze=False)
    drawn = 0
    for index, configuration in enumerate(configurations):
        axes = grid[index // columns][index % columns]
        for label in dict.fromkeys(label for _, label in cases):
            line = sorted((c["vocab"], c["fused"]["median_us_per_draw"],
                           c["reference"]["median_us_per_draw"]) for c, lb in cases
                          if c["configuration"] == configuration and lb == label)
            suffix = f", {label}" if label else ""
            axes.plot([p[0] for p in line], [p[1] for p in line], marker="o",
                      label="fused" + suffix)
            axes.plot([p[0] for p in line], [p[2] for p in line], marker="x", linestyle="--",
                      label="reference" + suffix)
            drawn += 2
        axes.set_title(configuration, fontsize=10)
        axes.set_xlabel("vocabulary")
        axes.set_ylabel("us per draw (median)")
        axes.set_xscale("log")
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    for index in range(len(configurations), rows * columns):
        grid[index // columns][index % columns].axis("off")
    figure.suptitle(args.title or "CPU sampling, us per draw: fused sampler against the reference",
                    fontsize=11)
    return figure, None, drawn


def plot_serve_sweep(plt, reports, labels, args):
    """TTFT, TPOT and ITL (median solid, p99 dashed) against the offered request rate, one
    colour per server; the SLOs as grey lines."""
    figure, grid = plt.subplots(1, 3, figsize=(15, 4.6), squeeze=False)
    drawn = 0
    for index, (report, label) in enumerate(zip(reports, labels)):
        name = label or report.get("label", f"input {index + 1}")
        rates = [r for r in report["rates"] if r["completed"]]
        xs = [r["request_rate"] if r["request_rate"] != "inf" else math.inf for r in rates]
        finite = [x for x in xs if x != math.inf]
        xs = [x if x != math.inf else (max(finite) * 2 if finite else 1) for x in xs]
        for axes, metric in zip(grid[0], ("ttft_ms", "tpot_ms", "itl_ms")):
            for stat, style in (("median", "-"), ("p99", "--")):
                axes.plot(xs, [r[metric][stat] for r in rates], marker="o", linestyle=style,
                          color=f"C{index % 10}", label=f"{name} {stat}")
            drawn += 1
    slos = {"ttft_ms": reports[0].get("slo_ttft_ms"), "tpot_ms": reports[0].get("slo_tpot_ms")}
    for axes, metric in zip(grid[0], ("ttft_ms", "tpot_ms", "itl_ms")):
        if slos.get(metric):
            axes.axhline(slos[metric], color="grey", linestyle=":",
                         label=f"SLO {slos[metric]:g} ms (p99)")
        axes.set_title(metric.split("_")[0].upper() + " (ms, log scale)", fontsize=10)
        axes.set_xlabel("offered request rate (requests/s)")
        axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    first = reports[0]
    figure.suptitle(args.title or (
        f"serving latency against request rate: {first.get('model', '?')}, "
        f"{first.get('dataset', '?')} requests"), fontsize=11)
    return figure, None, drawn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="`pagoda bench ... --json` output files")
    parser.add_argument("-o", "--output", required=True, help="the SVG file to write")
    parser.add_argument("--x", choices=["batch", "depth"], default="batch",
                        help="decode reports: the x axis")
    parser.add_argument("--label", action="append", default=[], help="a label per input")
    parser.add_argument("--peer", action="append", default=[],
                        help="attention reports: the anchor kit's decode.json or decode_tc.json "
                             "(FlashInfer's decode wrappers; repeat for both)")
    parser.add_argument("--paths", help="attention reports: the paths to draw, comma-separated "
                                        "(default: every path)")
    parser.add_argument("--title", help="default: from the report")
    args = parser.parse_args()
    if not args.output.endswith(".svg"):
        sys.exit("--output: only SVG is written; give a file name ending in .svg")
    if args.label and len(args.label) != len(args.inputs):
        sys.exit("--label: give one per input file, or none")

    reports = []
    for path in args.inputs:
        with open(path) as file:
            reports.append(json.load(file))
    reports = [from_llama_bench(r) if kind_of(r) == "llama-bench" else r for r in reports]
    kinds = {kind_of(report) for report in reports}
    if len(kinds) != 1:
        sys.exit(f"the inputs are reports of different kinds: {sorted(kinds)}")
    kind = kinds.pop()
    if args.peer and kind != "attention":
        sys.exit("--peer goes with `pagoda bench attention --json` reports")
    labels = args.label or [""] * len(reports)
    if kind == "decode" and len(set(labels)) < len(labels):
        reports, labels = pooled(reports, labels)

    plt = setup_matplotlib()
    draw = {"decode": plot_decode, "attention": plot_attention,
            "sampling-gpu": plot_sampling_gpu, "sampling-cpu": plot_sampling_cpu,
            "serve-sweep": plot_serve_sweep}[kind]
    figure, axes, drawn = draw(plt, reports, labels, args)
    if axes is not None:
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output, metadata={"Date": None})
    print(f"wrote {args.output}: {kind}, {drawn} line(s)")


if __name__ == "__main__":
    main()
