"""Batched put/get/exists: kvconn's Redis backend against plain redis-py doing the same work.

kvconn's backend is redis-py plus a deadline per call, error translation, key and buffer
checks and the copy into the caller's buffers; the question is what that costs. The
baseline is plain redis-py with the same protocol (RESP2) doing the same batches:
a ``SET key value NX`` pipeline, one ``MGET`` plus the copy of each value into a caller's
buffer (which kvconn must make too), and an ``EXISTS`` pipeline. ``redis-benchmark``
(C, pipelined, one client) runs alongside as the server's ceiling on this machine.

Each trial times ``--calls`` batches of each variant in a shuffled order (exists:
``--exists-calls``), so a busy neighbour slows both alike; the table gives throughput at the
median time and ``kvconn/raw`` as the median of the per-trial paired ratios with their
25th-75th percentiles. redis-benchmark runs between trials, ``--rb-runs`` times; its
median is shown.

``--cluster`` measures cluster mode on a 3-node Redis Cluster from
:mod:`kvconn.tools.devserver.redis`, against redis-py's ``RedisCluster`` pipeline doing
the same batches (``GET`` per key: a cluster ``MGET`` must stay in one slot).

Usage: ``python benchmarks/bench_redis.py [--cluster] [--values-kib 256 16] [--batch 64]
[--trials 40] [--calls 5]``
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvconn.backend import Backend
from kvconn.registry import load_backend
from kvconn.tools.devserver.redis import RedisCluster, RedisServer

OPS = ("put", "get", "exists")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--values-kib", type=int, nargs="+", default=[256, 16], help="value sizes (256 16)"
    )
    parser.add_argument("--batch", type=int, default=64, help="keys per batched call (64)")
    parser.add_argument("--trials", type=int, default=40, help="interleaved trials (40)")
    parser.add_argument("--calls", type=int, default=5, help="put and get calls a trial (5)")
    parser.add_argument("--exists-calls", type=int, default=20, help="exists calls a trial (20)")
    parser.add_argument("--rb-runs", type=int, default=5, help="redis-benchmark runs (5)")
    parser.add_argument(
        "--cluster", action="store_true", help="a 3-node Redis Cluster against redis-py's"
    )
    args = parser.parse_args(argv)
    for name in ("batch", "trials", "calls", "exists_calls", "rb_runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.values_kib) < 1:
        parser.error("--values-kib must be >= 1")
    return args


def redis_benchmark_argv(port: int, size: int, batch: int) -> list[list[str]]:
    """redis-benchmark runs shaped like kvconn's calls: one client, ``-P batch``."""
    requests = max(batch * 20, 25 * 2**20 // size)
    base = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "1", "-P", str(batch)]
    return [
        [*base, "-n", str(requests), "-d", str(size), "-t", "set,get", "--csv"],
        # EXISTS of the key the SET test wrote; it moves no payload, so many more requests.
        [*base, "-n", str(requests * 20), "--csv", "EXISTS", "key:__rand_int__"],
    ]


def redis_benchmark(port: int, size: int, batch: int) -> dict[str, float]:
    """requests/s of redis-benchmark SET, GET and EXISTS."""
    out: dict[str, float] = {}
    for argv in redis_benchmark_argv(port, size, batch):
        text = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
        for row in csv.reader(io.StringIO(text)):
            if len(row) >= 2 and row[0] != "test":
                op = {"SET": "put", "GET": "get", "EXISTS": "exists"}.get(row[0].split()[0].upper())
                if op:
                    out[op] = float(row[1])
    return out


class Trials:
    """Per-op, per-variant times of each trial, and what to print from them."""

    def __init__(self) -> None:
        self.times: dict[tuple[str, str], list[float]] = {}
        self.rb: dict[str, list[float]] = {}

    def add(self, op: str, variant: str, seconds: float) -> None:
        self.times.setdefault((op, variant), []).append(seconds)

    def rate(self, op: str, variant: str, count: int) -> float:
        return count / statistics.median(self.times[(op, variant)])

    def ratio(self, op: str) -> tuple[float, float, float]:
        """kvconn/raw throughput: median and p25-p75 of the per-trial paired ratios."""
        pairs = [
            raw / kv for kv, raw in zip(self.times[(op, "kvconn")], self.times[(op, "redis-py")])
        ]
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
        return statistics.median(pairs), q[0], q[2]


def compare(
    args: argparse.Namespace,
    size: int,
    kv: Backend,
    raw: Any,
    raw_values: Callable[[list[str]], list[Any]],
    flush: Callable[[], None],
    between: Callable[[int, Trials], None],
) -> Trials:
    """kvconn and redis-py doing the same batches, shuffled within each trial."""
    batch = args.batch
    values = [os.urandom(size) for _ in range(batch)]
    buffers = [bytearray(size) for _ in range(batch)]
    fixed = [f"bench/read/{i:04d}/page-0123456789abcdef" for i in range(batch)]
    trials = Trials()

    def keys(tag: str) -> list[str]:
        return [f"bench/{tag}/{i:04d}/page-0123456789abcdef" for i in range(batch)]

    def kv_put(tag: str) -> None:
        for call in range(args.calls):
            assert all(kv.put(keys(f"{tag}-{call}"), values))

    def raw_put(tag: str) -> None:
        for call in range(args.calls):
            pipe = raw.pipeline(transaction=False)
            for key, value in zip(keys(f"{tag}-{call}"), values):
                pipe.set(key, value, nx=True)
            pipe.execute()

    def kv_get() -> None:
        for _ in range(args.calls):
            assert all(kv.get(fixed, buffers))

    def raw_get_once() -> None:
        for value, buf in zip(raw_values(fixed), buffers):
            assert isinstance(value, bytes) and len(value) == len(buf)
            buf[:] = value  # the copy kvconn makes too

    def raw_get() -> None:
        # One call per function frame: a loop variable left holding the last value
        # across calls keeps the top of glibc's heap in use, which spares the next call
        # the page faults that kvconn's get (and any get that frees its replies) pays
        # after the heap is trimmed: 1.6-1.9x at 256 KiB, measured (docs/performance.md).
        for _ in range(args.calls):
            raw_get_once()

    def kv_exists() -> None:
        for _ in range(args.exists_calls):
            assert all(kv.exists(fixed))

    def raw_exists() -> None:
        for _ in range(args.exists_calls):
            pipe = raw.pipeline(transaction=False)
            for key in fixed:
                pipe.exists(key)
            assert all(pipe.execute())

    runs: dict[tuple[str, str], Callable[[str], None]] = {
        ("put", "kvconn"): kv_put,
        ("put", "redis-py"): raw_put,
        ("get", "kvconn"): lambda _tag: kv_get(),
        ("get", "redis-py"): lambda _tag: raw_get(),
        ("exists", "kvconn"): lambda _tag: kv_exists(),
        ("exists", "redis-py"): lambda _tag: raw_exists(),
    }
    kv.put(fixed, values)
    for warm in runs.values():  # connections open, code paths warm
        warm("warm")
    flush()
    for trial in range(args.trials):
        kv.put(fixed, values)
        order = list(runs)
        random.shuffle(order)
        for op, variant in order:
            run, tag = runs[(op, variant)], f"{variant}-{trial}"
            start = time.perf_counter()
            run(tag)
            trials.add(op, variant, time.perf_counter() - start)
        flush()
        between(trial, trials)
    assert bytes(buffers[-1]) == values[-1]
    return trials


def cell(op: str, ops_per_s: float | None, size: int) -> str:
    """One table cell: GB/s and ops/s, or keys/s alone for exists (no payload)."""
    if ops_per_s is None:
        return f"{'-':>24}"
    if op == "exists":
        return f"{ops_per_s:>14,.0f} keys/s   "
    return f"{ops_per_s * size / 1e9:>6.2f} GB/s {ops_per_s:>8,.0f}/s "


def report(args: argparse.Namespace, size: int, trials: Trials, title: str) -> None:
    print(title)
    impls = ["kvconn", "redis-py", *(["redis-benchmark"] if trials.rb else [])]
    print(f"{'op':<7}" + "".join(f"{name:>24}" for name in impls) + "   kvconn/raw [p25-p75]")
    for op in OPS:
        count = args.batch * (args.exists_calls if op == "exists" else args.calls)
        rates: dict[str, float | None] = {
            impl: trials.rate(op, impl, count) for impl in ("kvconn", "redis-py")
        }
        if trials.rb:
            found = trials.rb.get(op)
            rates["redis-benchmark"] = statistics.median(found) if found else None
        mid, low, high = trials.ratio(op)
        cells = "".join(cell(op, rates[impl], size) for impl in impls)
        print(f"{op:<7}{cells}   {mid:>5.2f} [{low:.2f}-{high:.2f}]")


def header(args: argparse.Namespace, server_info: Any, size: int) -> str:
    import redis

    version = next(
        (
            line.split(":", 1)[1].strip()
            for line in _text(server_info).splitlines()
            if line.startswith("redis_version:")
        ),
        "?",
    )
    hiredis = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "no hiredis"
    return (
        f"redis-server {version}, redis-py {redis.__version__} ({hiredis}, RESP2), "
        f"{os.cpu_count()} CPUs; values {size // 1024} KiB, batch {args.batch}, "
        f"{args.trials} interleaved trials ({args.calls} put/get and {args.exists_calls} "
        "exists calls each)"
    )


def single(args: argparse.Namespace) -> int:
    import redis

    problem = RedisServer.available()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    have_rb = shutil.which("redis-benchmark") is not None
    with RedisServer() as server:
        kv = load_backend("redis", server.options)
        raw = redis.Redis(host="127.0.0.1", port=server.port, protocol=2)

        def flush() -> None:
            server.command("FLUSHALL", "SYNC")

        every = max(1, args.trials // args.rb_runs)
        for size in (kib * 1024 for kib in args.values_kib):

            def between(trial: int, trials: Trials, size: int = size) -> None:
                if have_rb and (trial + 1) % every == 0:
                    for op, rate in redis_benchmark(server.port, size, args.batch).items():
                        trials.rb.setdefault(op, []).append(rate)
                    flush()

            trials = compare(args, size, kv, raw, raw.mget, flush, between)
            report(args, size, trials, header(args, server.command("INFO", "server"), size))
            if have_rb:
                for run in redis_benchmark_argv(0, size, args.batch):
                    print("  redis-benchmark " + " ".join(run[5:]))
            else:
                print("  redis-benchmark: not found, its column is left out")
            print()
        kv.close()
        raw.close()
    return 0


def cluster(args: argparse.Namespace) -> int:
    import redis.cluster

    problem = RedisCluster.available()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    with RedisCluster(3) as servers:
        kv = load_backend("redis", servers.options)
        raw: Any = redis.cluster.RedisCluster(host="127.0.0.1", port=servers.ports[0], protocol=2)

        def raw_values(keys: list[str]) -> list[Any]:
            pipe = raw.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return list(pipe.execute())

        def flush() -> None:
            for node in servers.nodes:
                node.command("FLUSHALL", "SYNC")

        for size in (kib * 1024 for kib in args.values_kib):
            trials = compare(args, size, kv, raw, raw_values, flush, lambda _t, _trials: None)
            info = servers.nodes[0].command("INFO", "server")
            report(args, size, trials, header(args, info, size) + "; a 3-node cluster")
            print()
        kv.close()
        raw.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cluster(args) if args.cluster else single(args)


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


if __name__ == "__main__":
    sys.exit(main())
