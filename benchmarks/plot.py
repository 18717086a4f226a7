"""Draw the benchmark results as PNGs: ``results/<name>.json`` -> ``results/<name>.png``.

- ``kernel*.json`` (bench_kernel.py): GB/s of valid K/V bytes against B, this project and
  ``mx.fast`` SDPA per dtype, one panel per head shape and length mix, the measured read
  bandwidth as a line;
- ``context*.json`` (bench_context.py): graph-build and step time against B, context built once
  vs per layer, one line per layer count N;
- ``decode*.json`` (bench_decode.py): steady decode tokens/s per batch size and path.

Needs matplotlib (``pip install 'mlx-batched-decode[plot]'``).

    python benchmarks/plot.py                  # every known results/*.json
    python benchmarks/plot.py results/decode.json
"""

import argparse
import json
import pathlib
import sys

from common import RESULTS

PATH_COLORS = {"slot": "tab:blue", "seed": "tab:orange", "mlx-lm": "tab:green"}
DTYPE_COLORS = {"float16": "tab:blue", "bfloat16": "tab:purple", "float32": "tab:green"}


def machine_line(data):
    m = data["machine"]
    return f"{m['cpu']}, {m['cores']} cores, {m['platform']}"


def plot_kernel(plt, data):
    rows = data["rows"]
    heads_list = sorted({r["heads"] for r in rows})
    # One panel per head layout and length kind; kinds run at a single B (the 8k
    # request) are points, not curves, and stay in the JSON and the README table.
    kinds = sorted({r["lengths"] for r in rows if len({q["B"] for q in rows if q["lengths"] == r["lengths"]}) > 1})
    fig, axes = plt.subplots(
        len(heads_list), len(kinds), figsize=(5 * len(kinds), 3.6 * len(heads_list)), squeeze=False
    )
    panels = [(h, k) for h in heads_list for k in kinds]
    for ax, (heads, kind) in zip(axes.flat, panels):
        for dtype, color in DTYPE_COLORS.items():
            mine = [r for r in rows if (r["heads"], r["lengths"], r["dtype"]) == (heads, kind, dtype)]
            mine.sort(key=lambda r: r["B"])
            if not mine:
                continue
            ax.plot([r["B"] for r in mine], [r["gbs"] for r in mine], "o-", color=color, label=f"ours {dtype}")
            peer = [r for r in mine if r.get("sdpa_gbs") is not None]
            if peer:
                ax.plot(
                    [r["B"] for r in peer], [r["sdpa_gbs"] for r in peer], "x--",
                    color=color, label=f"mx.fast SDPA {dtype}",
                )
        ax.axhline(data["machine"]["read_bandwidth_gbs"], color="gray", linestyle=":", label="read bandwidth")
        ax.set(
            title=f"{heads}, {kind} lengths", xlabel="B (requests)", ylabel="GB/s of valid K/V",
            xscale="log", yscale="log",
        )
        ax.set_xticks(sorted({r["B"] for r in rows}), [str(b) for b in sorted({r["B"] for r in rows})])
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Decode attention kernel (median per layer)\n{machine_line(data)}", fontsize=9)
    return fig


def plot_context(plt, data):
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("build_ms", "step_ms"), ("graph build (host)", "whole step (build + eval)")):
        for i, layers in enumerate(sorted({r["N"] for r in rows})):
            for context, style in (("once", "o-"), ("per-layer", "x--")):
                mine = sorted((r for r in rows if r["N"] == layers and r["context"] == context), key=lambda r: r["B"])
                ax.plot(
                    [r["B"] for r in mine], [r[key] for r in mine], style,
                    color=f"C{i}", label=f"N={layers}, context {context}",
                )
        ax.set(title=title, xlabel="B (requests)", ylabel="ms per step (median)", xscale="log", yscale="log")
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
        ax.set_xticks(sorted({r["B"] for r in rows}), [str(b) for b in sorted({r["B"] for r in rows})])
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Decode context built once vs per layer\n{machine_line(data)}", fontsize=9)
    return fig


def plot_decode(plt, data):
    rows = data["rows"]
    batches = sorted({r["B"] for r in rows})
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(paths)
    for j, path in enumerate(paths):
        values = [next(r["steady_tok_s"] for r in rows if r["B"] == b and r["path"] == path) for b in batches]
        x = [i + j * width for i in range(len(batches))]
        bars = ax.bar(x, values, width, label=path, color=PATH_COLORS.get(path))
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(batches))], [f"B={b}" for b in batches])
    low, high = data["context_range"]
    ax.set(ylabel="decode tokens/s (steps 2..)")
    ax.legend()
    fig.suptitle(
        f"End-to-end greedy decode, contexts {low}-{high}, {data['max_tokens']} tokens each\n{machine_line(data)}",
        fontsize=9,
    )
    return fig


PLOTTERS = {"kernel": plot_kernel, "context": plot_context, "decode": plot_decode}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "files", nargs="*", type=pathlib.Path, help="results JSON files (default: all known in results/)"
    )
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py needs matplotlib: pip install 'mlx-batched-decode[plot]' (or pip install matplotlib)")

    files = args.files or sorted(p for p in RESULTS.glob("*.json") if p.stem.split("_")[0] in PLOTTERS)
    if not files:
        sys.exit(f"no results to draw in {RESULTS}: run the bench_*.py scripts first")
    for path in files:
        kind = path.stem.split("_")[0]
        if kind not in PLOTTERS:
            sys.exit(f"{path}: unknown results file (expected a name starting with {', '.join(PLOTTERS)})")
        fig = PLOTTERS[kind](plt, json.loads(path.read_text()))
        fig.tight_layout()
        out = path.with_suffix(".png")
        fig.savefig(out, dpi=120)
        plt.close(fig)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
