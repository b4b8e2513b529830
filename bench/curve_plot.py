"""Draws one backend's concurrency curve from the CSV bench/curve.sh wrote for it, and from
nothing else: calls/s, p50 latency and p99 latency against callers, payledger's four write
scenarios beside the database's own benchmark (pgbench tpcb-like or sysbench oltp_write_only,
whose transactions/s stand for calls/s). Every axis is logarithmic, so the vertical distance
between two lines of the throughput panel is their ratio. A concurrency the database's
benchmark could not run (an empty row) is left out of its line and named under the picture.
Re-drawing the same CSV with the same matplotlib gives the same SVG byte for byte.

Usage: curve_plot.py <curve-<backend>.csv> <picture.svg>
"""

import csv
import pathlib
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "payledger-curve"  # stable ids in the SVG
import matplotlib.pyplot as plt  # noqa: E402

BACKENDS = {
    "postgres": ("PostgreSQL", "pgbench tpcb-like (prepared, scale 32)"),
    "mysql": ("MariaDB", "sysbench oltp_write_only (8 tables of 10,000 rows)"),
}
# (series in the CSV, legend label, line style)
SERIES = [
    ("database", None, {"color": "black", "linestyle": "--", "marker": "s", "linewidth": 2}),
    ("pay", "payledger pay", {"color": "tab:blue", "marker": "o"}),
    ("keyed-pay", "payledger keyed-pay", {"color": "tab:orange", "marker": "^"}),
    ("transfer", "payledger transfer", {"color": "tab:green", "marker": "D"}),
    ("refund", "payledger refund", {"color": "tab:red", "marker": "v"}),
]
PANELS = [  # (column of a row, panel title, y axis label)
    ("calls_per_second", "Throughput", "calls/s (database: transactions/s), log scale"),
    ("p50_ms", "p50 latency", "p50 latency, ms, log scale"),
    ("p99_ms", "p99 latency", "p99 latency, ms, log scale"),
]


def read(path: pathlib.Path) -> tuple[str, dict, list]:
    """The backend, each series' rows by concurrency, and the concurrencies without a database figure."""
    backend, series, missing = None, {}, []
    for row in csv.DictReader(path.open()):
        backend = backend or row["backend"]
        if not row["calls_per_second"]:
            missing.append(int(row["concurrency"]))
            continue
        series.setdefault(row["series"], []).append(
            {"callers": int(row["concurrency"]), **{column: float(row[column]) for column, _, _ in PANELS}}
        )
    if backend not in BACKENDS:
        sys.exit(f"{path}: no rows of a known backend ({', '.join(BACKENDS)})")
    return backend, series, sorted(set(missing))


def number(value: float, _position=None) -> str:
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, picture = pathlib.Path(sys.argv[1]), sys.argv[2]
    backend, series, missing = read(source)
    database_name, reference = BACKENDS[backend]
    callers = sorted({point["callers"] for points in series.values() for point in points} | set(missing))

    figure = plt.figure(figsize=(10, 9))
    grid = figure.add_gridspec(2, 2, height_ratios=[1.15, 1])
    axes = [figure.add_subplot(grid[0, :]), figure.add_subplot(grid[1, 0]), figure.add_subplot(grid[1, 1])]
    for axis, (column, title, label) in zip(axes, PANELS):
        for name, legend, style in SERIES:
            points = sorted(series.get(name, []), key=lambda point: point["callers"])
            if points:
                axis.plot([p["callers"] for p in points], [p[column] for p in points],
                          label=legend or reference, **style)
        axis.set_xscale("log", base=2)
        axis.set_xticks(callers)
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(number))
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1, 2, 5)))
        axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(number))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("concurrent callers (database: clients), log scale")
        axis.set_ylabel(label)
        axis.set_title(f"{title} against callers", fontsize=11)
        axis.grid(True, which="major", alpha=0.35)
        axis.grid(True, which="minor", axis="y", alpha=0.12)
    axes[0].legend(fontsize=9, loc="lower right")
    figure.suptitle(f"{database_name}: payledger's write paths beside {reference}", fontsize=13)
    if missing:
        figure.text(0.5, 0.005, f"{reference.split(' (')[0]} has no figure at "
                    f"{', '.join(map(str, missing))} clients (more connections than the server allows)",
                    ha="center", va="bottom", fontsize=9)
    figure.tight_layout(rect=(0, 0.02 if missing else 0, 1, 1))
    figure.savefig(picture, metadata={"Date": None})


if __name__ == "__main__":
    main()
