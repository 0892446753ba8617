"""Puts while a storage process is dead: what kvconn's reroute and steering are worth.

Until the master drops a dead storage process's segment (``client_ttl``, 10 s by
default) it keeps placing new objects there. A batch with a key placed there fails that
key with ``-800``, and after the first such failure each one waits out a transfer
timeout before it does (~1 s after the client's previous failure, measured on Mooncake
0.3.13's TCP transport; a failure a second or more after the last is quick). The
benchmark starts a master and storage processes (``--storage``, 2), kills one, and puts
batches from one client of the same store per variant; each round runs every client's
batches back to back, as an engine's saves come, the clients in a shuffled order:

* ``no reroute`` - the keys placed on the dead process are dropped (what a client with
  no fail-over stores);
* ``reroute`` - they are put again on segments seen alive, but every batch's first try
  is placed freely (kvconn before 2026-12-06's steering);
* ``fixed order`` - steered, but every batch names the live segments in one order (kvconn
  until 2026-12-06, stop 50): the master puts a batch on the first preferred segment
  with room, so one live segment takes every steered write;
* ``kvconn`` - as shipped: after a reroute, new batches prefer the live segments from
  their first try while the death is recent, naming them in a new order each batch.

It prints, per variant, the median and slowest time of a batch, the keys stored, and
the share of their copies on the busiest storage process (even: one in as many as are
alive).
``--replicas 2`` with two storage processes shows the case nothing helps: every
placement needs the dead process; with ``--storage 3`` two live ones can take both.

Usage: ``python -m benchmarks.bench_mooncake_death [--rounds 3] [--batches 6] [--keys 8]
[--value-kib 64] [--replicas 1] [--storage 2]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import Counter
from typing import Any

from kvconn.registry import load_backend
from kvconn.tools.devserver.mooncake import MooncakeCluster, ready_to_benchmark

MiB = 2**20
VARIANTS = ("no reroute", "reroute", "fixed order", "kvconn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    parser.add_argument(
        "--batches", type=int, default=6, help="batches per variant and round, back to back (6)"
    )
    parser.add_argument("--keys", type=int, default=8, help="keys per batch (8)")
    parser.add_argument("--value-kib", type=int, default=64, help="bytes per key, KiB (64)")
    parser.add_argument("--replicas", type=int, default=1, help="replica_num (1)")
    parser.add_argument(
        "--storage", type=int, default=2, help="storage processes, one of which dies (2)"
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.batches, args.keys, args.value_kib, args.replicas) < 1:
        parser.error("--rounds, --batches, --keys, --value-kib and --replicas must be >= 1")
    if args.storage < 2:
        parser.error("--storage must be >= 2: one dies, the others keep the store up")
    return args


def open_variant(cluster: MooncakeCluster, variant: str, replicas: int) -> Any:
    """A backend whose reroute is cut back to what ``variant`` names."""
    options = {**cluster.options, "read_env": False, "replica_num": replicas}
    backend: Any = load_backend("mooncake", options)
    transfers = backend._transfers
    if variant == "no reroute":
        transfers._reroute_puts = lambda store, batch, results, tried: results
    elif variant == "reroute":  # first tries placed freely; reroutes as shipped
        transfers._put_config = lambda: transfers._replicate
    elif variant == "fixed order":
        transfers._reroute._in_turn = lambda segments: segments
    return backend


def busiest_share(backend: Any, keys: list[str]) -> float:
    """The share of ``keys``' copies that lie on the storage process holding most."""
    described = backend._transfers.describe(keys)
    held = Counter(c.endpoint for found in described.values() for c in found.copies)
    return max(held.values()) / sum(held.values()) if held else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready_to_benchmark():
        return 2
    size = args.value_kib * 1024
    segment = max(64 * MiB, 4 * args.rounds * args.batches * args.keys * size * args.replicas)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    stored: dict[str, list[str]] = {v: [] for v in VARIANTS}
    # client_ttl: the master keeps listing the dead segment for the whole run
    with MooncakeCluster(
        storage_processes=args.storage, segment_size=segment, client_ttl=600
    ) as cluster:
        backends = {v: open_variant(cluster, v, args.replicas) for v in VARIANTS}
        try:
            cluster.kill_storage(0)
            order = list(VARIANTS)
            for r in range(args.rounds):
                random.shuffle(order)
                for variant in order:  # back to back, as an engine's saves come
                    for b in range(args.batches):
                        name = variant.replace(" ", "-")
                        keys = [f"{name}/{r}/{b}/{i}" for i in range(args.keys)]
                        values = [os.urandom(size) for _ in keys]
                        started = time.perf_counter()
                        landed = backends[variant].put(keys, values)
                        times[variant].append(time.perf_counter() - started)
                        stored[variant] += [k for k, ok in zip(keys, landed) if ok]
            busiest = {v: busiest_share(backends[v], stored[v]) for v in VARIANTS}
        finally:
            for backend in backends.values():
                backend.close()
    total = args.rounds * args.batches * args.keys
    print(
        f"{args.rounds} rounds of {args.batches} batches of {args.keys} x {args.value_kib} KiB "
        f"per variant, replica_num {args.replicas}, one of {args.storage} storage processes dead:"
    )
    print(
        f"{'variant':<13}{'median ms':>10}{'slowest ms':>12}{'first ms':>10}{'stored':>10}"
        f"{'busiest':>9}"
    )
    for variant in VARIANTS:
        t = times[variant]
        print(
            f"{variant:<13}{statistics.median(t) * 1e3:>10.1f}{max(t) * 1e3:>12.1f}"
            f"{t[0] * 1e3:>10.1f}{f'{len(stored[variant])}/{total}':>10}"
            f"{busiest[variant]:>9.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
