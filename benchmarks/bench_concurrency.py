"""What declaring a backend thread-safe buys: a lookup that arrives during a large save.

An engine calls the store from several threads at once: a save thread puts a large
batch while the scheduler thread asks ``exists`` for the next request's prefix. A
connector serializes its calls to a backend that does not declare
``Capabilities.thread_safe`` with one lock per backend, so the lookup then waits for the
whole save. This benchmark measures that wait on real stores it starts itself (a
``redis-server`` and a Mooncake master with one storage process, on free loopback
ports, and an LMDB store in a temporary directory): one thread puts a batch of
``--batch`` fresh values, another issues small ``exists`` calls one after another with
a short pause between them (``--gap-ms``, as a scheduler asks between steps), and every
``exists`` that starts while the put runs is timed. Two ways, alternating in a shuffled
order every trial:

* ``locked`` - both threads take one ``threading.Lock`` around every backend call, as
  the connector does for a backend that is not thread-safe;
* ``free`` - no lock, as the connector calls a thread-safe backend.

The put is timed from when it holds the lock (if any) to its end. Without the pause, a
tight loop of lookups can keep an unfair ``threading.Lock`` to itself and starve the put
(seen here: a 57 ms put waited behind 47 lookups), a different problem from the one
measured. Reported per backend: the put's median duration, the median latency of the ``exists``
calls that started during the put, how many such calls were answered per put, the
median of ``exists`` calls with nothing else running (the calls before each put), and
``locked/free``: the ratio of the two medians during the put. Each put writes fresh keys
(a put never overwrites, so rewriting keys would cost the stores nothing), deleted after
the trial, untimed. Mooncake puts from registered memory, as the connector's staging.

Usage: ``python benchmarks/bench_concurrency.py [--trials 15] [--batch 64]
[--redis-value-kib 256] [--mooncake-value-kib 1024] [--lmdb-value-kib 1024]
[--exists-keys 32] [--gap-ms 1] [--backends redis mooncake lmdb]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvconn.backend import Backend
from kvconn.registry import load_backend
from kvconn.tools.devserver.mooncake import MooncakeCluster, keep_transfers_on_loopback
from kvconn.tools.devserver.redis import RedisServer

MiB = 2**20
MODES = ("locked", "free")
#: ``exists`` calls to finish before the put starts: the idle baseline, and a sign that
#: the exists thread is running.
IDLE_CALLS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=15, help="interleaved trials (15)")
    parser.add_argument("--batch", type=int, default=64, help="values per put (64)")
    parser.add_argument("--redis-value-kib", type=int, default=256, help="Redis value (256)")
    parser.add_argument(
        "--mooncake-value-kib", type=int, default=1024, help="Mooncake value (1024)"
    )
    parser.add_argument("--lmdb-value-kib", type=int, default=1024, help="LMDB value (1024)")
    parser.add_argument("--exists-keys", type=int, default=32, help="keys per exists (32)")
    parser.add_argument(
        "--gap-ms", type=float, default=1.0, help="pause between exists calls, ms (1)"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=("redis", "mooncake", "lmdb"),
        default=["redis", "mooncake", "lmdb"],
        help="which stores (all three)",
    )
    args = parser.parse_args(argv)
    for name in (
        "trials",
        "batch",
        "redis_value_kib",
        "mooncake_value_kib",
        "lmdb_value_kib",
        "exists_keys",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gap_ms < 0:
        parser.error("--gap-ms must be >= 0")
    return args


@dataclass
class Samples:
    """One mode's measurements over all trials (seconds)."""

    puts: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)  # exists started while the put ran
    answered: list[int] = field(default_factory=list)  # such exists calls, per put
    idle: list[float] = field(default_factory=list)  # exists before the put started


def one_trial(
    backend: Backend,
    put_keys: list[str],
    values: list[Any],
    probe: list[str],
    lock: threading.Lock | None,
    gap: float,
    into: Samples,
) -> None:
    """Put ``values`` on this thread while another thread loops ``exists(probe)``."""
    guard: contextlib.AbstractContextManager[object] = lock or contextlib.nullcontext()
    clock = time.perf_counter
    calls: list[tuple[float, float]] = []
    warmed, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def lookups() -> None:
        try:
            while not stop.is_set():
                start = clock()
                with guard:
                    backend.exists(probe)
                calls.append((start, clock()))
                if len(calls) == IDLE_CALLS:
                    warmed.set()
                time.sleep(gap)
        except BaseException as exc:
            failure.append(exc)
            warmed.set()

    thread = threading.Thread(target=lookups)
    thread.start()
    try:
        warmed.wait(timeout=60)
        with guard:
            begin = clock()
            stored = backend.put(put_keys, values)
            end = clock()
    finally:
        stop.set()
        thread.join(timeout=60)
    if failure:
        raise failure[0]
    assert all(stored), "a put was refused: is the store full?"
    during = [finish - start for start, finish in calls if begin <= start < end]
    into.puts.append(end - begin)
    into.during.extend(during)
    into.answered.append(len(during))
    into.idle.extend(finish - start for start, finish in calls if finish <= begin)


def run_backend(
    name: str, backend: Backend, values: list[Any], args: argparse.Namespace
) -> dict[str, Samples]:
    """Alternate the two modes over ``args.trials`` trials; fresh keys for every put."""
    probe = [
        f"bench/concurrency/probe/{i:04d}/page-0123456789abcdef" for i in range(args.exists_keys)
    ]
    backend.put(probe[::2], [b"x" * 64] * len(probe[::2]))  # half present, half absent
    samples = {mode: Samples() for mode in MODES}
    lock = threading.Lock()
    for trial in range(args.trials):
        order = list(MODES)
        random.shuffle(order)
        for mode in order:
            keys = [f"bench/concurrency/{name}/{trial}/{mode}/{i:04d}" for i in range(len(values))]
            one_trial(
                backend,
                keys,
                values,
                probe,
                lock if mode == "locked" else None,
                args.gap_ms / 1000,
                samples[mode],
            )
            backend.delete(keys)  # untimed: the store stays as empty as it started
    return samples


@contextlib.contextmanager
def redis_store(args: argparse.Namespace) -> Iterator[tuple[Backend, list[Any], str]]:
    size = args.redis_value_kib * 1024
    with RedisServer() as server:
        backend = load_backend("redis", {**server.options, "timeout_s": 60.0})
        payload = memoryview(bytearray(os.urandom(size * args.batch)))
        values = [payload[i * size : (i + 1) * size] for i in range(args.batch)]
        try:
            yield backend, values, f"redis-server, values {args.redis_value_kib} KiB"
        finally:
            backend.close()


@contextlib.contextmanager
def mooncake_store(args: argparse.Namespace) -> Iterator[tuple[Backend, list[Any], str]]:
    keep_transfers_on_loopback()
    size = args.mooncake_value_kib * 1024
    span = size * args.batch
    with MooncakeCluster(storage_processes=1, segment_size=max(64 * MiB, 4 * span)) as cluster:
        backend = load_backend("mooncake", {**cluster.options, "read_env": False})
        staging = memoryview(bytearray(os.urandom(span)))
        backend.register_buffer(staging)  # as the connector's staging: zero-copy puts
        values = [staging[i * size : (i + 1) * size] for i in range(args.batch)]
        try:
            yield (
                backend,
                values,
                (
                    f"Mooncake (storage process), values {args.mooncake_value_kib} KiB, "
                    "registered memory"
                ),
            )
        finally:
            backend.unregister_buffer(staging)
            backend.close()


@contextlib.contextmanager
def lmdb_store(args: argparse.Namespace) -> Iterator[tuple[Backend, list[Any], str]]:
    size = args.lmdb_value_kib * 1024
    with tempfile.TemporaryDirectory(prefix="kvconn-bench-lmdb-") as path:
        # A map large enough from the start: growing it is not what is measured.
        backend = load_backend(
            "lmdb", {"path": path, "map_size": max(1 << 30, 4 * size * args.batch)}
        )
        payload = memoryview(bytearray(os.urandom(size * args.batch)))
        values = [payload[i * size : (i + 1) * size] for i in range(args.batch)]
        try:
            yield backend, values, f"LMDB (page cache, sync off), values {args.lmdb_value_kib} KiB"
        finally:
            backend.close()


def _lmdb_available() -> str | None:
    return None  # embedded: a temporary directory is all it needs


def ms(seconds: float) -> str:
    return f"{seconds * 1000:9.2f}"


def report(name: str, what: str, samples: dict[str, Samples], args: argparse.Namespace) -> None:
    locked, free = samples["locked"], samples["free"]
    print(
        f"\n{name}: {what}; put of {args.batch} values, exists of {args.exists_keys} keys, "
        f"{args.trials} trials"
    )
    print(
        f"{'mode':8} {'put ms':>9} {'exists ms during put':>21} {'answered/put':>13} "
        f"{'exists ms idle':>15}"
    )
    for mode, s in (("locked", locked), ("free", free)):
        print(
            f"{mode:8} {ms(statistics.median(s.puts))} {ms(statistics.median(s.during)):>21} "
            f"{statistics.median(s.answered):>13g} {ms(statistics.median(s.idle)):>15}"
        )
    ratio = statistics.median(locked.during) / statistics.median(free.during)
    print(f"locked/free, exists during the put: {ratio:.1f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stores = {
        "redis": (RedisServer.available, redis_store),
        "mooncake": (MooncakeCluster.available, mooncake_store),
        "lmdb": (_lmdb_available, lmdb_store),
    }
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for name in args.backends:
        available, opened = stores[name]
        problem = available()
        if problem:
            print(f"{name}: cannot run: {problem}", file=sys.stderr)
            return 2
        with opened(args) as (backend, values, what):
            samples = run_backend(name, backend, values, args)
        report(name, what, samples, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
