"""Draws bench/curve.sh's figures: for each backend measured, calls/s and p50 latency against
callers (both axes logarithmic), payledger's scenarios beside the database's own benchmark.

Usage: curve_plot.py <folder with curve-<backend>.csv> <picture.svg>
"""

import csv
import pathlib
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BACKENDS = {"postgres": "PostgreSQL (database: pgbench tpcb-like)", "mysql": "MariaDB (database: sysbench oltp_write_only)"}
SERIES = ["database", "pay", "keyed-pay", "transfer", "refund"]


def read(folder: pathlib.Path) -> dict:
    figures = {}
    for backend in BACKENDS:
        path = folder / f"curve-{backend}.csv"
        if not path.exists():
            continue
        for row in csv.DictReader(path.open()):
            if not row["calls_per_second"]:
                continue  # the database's benchmark could not run this concurrency
            series = figures.setdefault(backend, {}).setdefault(row["series"], [])
            series.append((int(row["concurrency"]), float(row["calls_per_second"]), float(row["p50_ms"])))
    return figures


def main() -> None:
    folder, picture = pathlib.Path(sys.argv[1]), sys.argv[2]
    figures = read(folder)
    if not figures:
        sys.exit(f"no curve-<backend>.csv in {folder}")
    figure, axes = plt.subplots(len(figures), 2, figsize=(11, 4.2 * len(figures)), squeeze=False)
    for row, (backend, series) in enumerate(figures.items()):
        rate_axis, latency_axis = axes[row]
        for name in SERIES:
            points = sorted(series.get(name, []))
            if not points:
                continue
            style = {"linestyle": "--", "color": "black"} if name == "database" else {"marker": "o"}
            callers = [point[0] for point in points]
            rate_axis.plot(callers, [point[1] for point in points], label=name, **style)
            latency_axis.plot(callers, [point[2] for point in points], label=name, **style)
        for axis, label in ((rate_axis, "calls (transactions) / s"), (latency_axis, "p50 latency, ms")):
            axis.set_xscale("log", base=2)
            axis.set_xticks(sorted({point[0] for points in series.values() for point in points}))
            axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            axis.set_yscale("log")
            axis.set_xlabel("concurrent callers (clients)")
            axis.set_ylabel(label)
            axis.grid(True, which="both", alpha=0.3)
        rate_axis.set_title(BACKENDS[backend], fontsize=10)
        latency_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(picture)


if __name__ == "__main__":
    main()
