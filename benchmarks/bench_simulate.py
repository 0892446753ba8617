"""Where the time of the default ``kvconn simulate`` run goes.

Runs the Quick start configuration (minimax-m3, TP=8, 2 layers, the default workload)
on a fresh LMDB directory twice: a cold store (everything computed and written) and a
warm one (everything loaded and verified). For each it prints the wall time, the time
per request and the split of the ranks' time between the store (inside backend calls),
data movement (gather/scatter and staging copies), planning (hashing, keys, owners),
and the simulation's own work (computing the stand-in bytes and verifying loads).

CPU seconds are the reliable split when there are more ranks than cores (8 ranks on a
2-core machine spend much of their wall time waiting for a core); wall seconds are
printed as well.

    python benchmarks/bench_simulate.py
    python benchmarks/bench_simulate.py --repeat 3 -- --model deepseek-v3.2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

from kvconn.tools.cli import build_parser
from kvconn.tools.simulate import settings_from_args
from kvconn.tools.simulate.runner import simulate

PARTS = ("store", "movement", "planning", "compute", "verify")


def run_once(extra: list[str], path: str) -> dict[str, Any]:
    args = build_parser().parse_args(["simulate", "--path", path, "--no-progress", *extra])
    report: dict[str, Any] = simulate(settings_from_args(args))
    if report["errors"]:
        raise SystemExit(f"verification failed: {report['error_examples']}")
    return report


def row(label: str, reports: list[dict[str, Any]]) -> str:
    def med(key: str) -> float:
        return statistics.median(float(r[key]) for r in reports)

    cpu = {p: statistics.median(float(r["cpu_s"][p]) for r in reports) for p in PARTS}
    total = sum(cpu.values()) or 1.0
    shares = " ".join(f"{cpu[p] / total:>8.0%}" for p in PARTS)
    return (
        f"{label:<11} {med('wall_s'):>7.2f} {med('startup_s'):>7.2f} {med('replay_s'):>7.2f} "
        f"{med('time_per_request_s') * 1000:>8.1f} {shares}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per row (median)")
    parser.add_argument("simulate_args", nargs="*", help="extra `kvconn simulate` flags")
    opts = parser.parse_args()
    cold: list[dict[str, Any]] = []
    warm: list[dict[str, Any]] = []
    for _ in range(opts.repeat):
        with tempfile.TemporaryDirectory(prefix="kvconn-bench-") as tmp:
            path = os.path.join(tmp, "store")
            cold.append(run_once(opts.simulate_args, path))
            warm.append(run_once(opts.simulate_args, path))
    r = cold[0]
    print(
        f"kvconn simulate: {r['model']}, TP={r['tp']}, {r['layers']} layers, "
        f"{r['requests']} requests, {r['prompt_tokens']:,} prompt tokens, {r['backend']}; "
        f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}"
    )
    print(
        f"{'store':<11} {'wall s':>7} {'start s':>7} {'replay':>7} {'ms/req':>8} "
        + " ".join(f"{p:>8}" for p in PARTS)
        + "   (shares of CPU time)"
    )
    print(row("cold", cold))
    print(row("warm", warm))
    for label, reports in (("cold", cold), ("warm", warm)):
        rep = reports[0]
        cpu = ", ".join(f"{p} {rep['cpu_s'][p]:.2f}" for p in PARTS)
        wall = ", ".join(f"{p} {rep['time_s'][p]:.2f}" for p in PARTS)
        print(
            f"{label}: hit {rep['hit_rate']:.1%}, stored {rep['bytes_stored'] / 2**20:.1f} MiB, "
            f"pages loaded {rep['pages_loaded']:,}; CPU s: {cpu}; wall s: {wall}"
        )


if __name__ == "__main__":  # rank processes re-import this module: keep the guard
    main()
