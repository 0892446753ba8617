"""Batched put/get/exists throughput: kvconn's Redis backend vs redis-py vs redis-benchmark.

Why three columns: ``redis-benchmark`` (C, pipelined) is the ceiling the server allows
on this machine; raw redis-py doing the *same* batched work (SET NX pipeline, MGET plus
the copy into caller buffers that kvconn must make, EXISTS pipeline) is what a naive
backend would get. The ratios say how close kvconn's own RESP path comes to the former
and how much it gains over the latter. Runs are interleaved and the best of
``--repeats`` is kept, because a shared 2-core machine is noisy.

``--cluster`` measures cluster mode instead, on a 3-node Redis Cluster from
:mod:`kvconn.tools.devserver.redis`: kvconn's cluster backend against redis-py's
``RedisCluster`` doing the same batches through its non-transactional pipeline (SET NX,
GET plus the copy into caller buffers, EXISTS; one round trip per node either way) —
what kvconn's cluster mode did before it drove the nodes with its own RESP path.
redis-benchmark has no batched cluster mode to compare with.

Usage: ``python benchmarks/bench_redis.py [--cluster] [--values-kib 256] [--batch 64]
[--rounds 20]``
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvconn.backend import Backend
from kvconn.registry import load_backend
from kvconn.tools.devserver.redis import RedisCluster, RedisServer

Best = dict[tuple[str, str], float]  # (op, implementation) -> best ops/s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--values-kib", type=int, default=256, help="value size in KiB (256)")
    parser.add_argument("--batch", type=int, default=64, help="keys per batched call (64)")
    parser.add_argument("--rounds", type=int, default=20, help="batches per measurement (20)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats, best kept (5)")
    parser.add_argument(
        "--cluster", action="store_true", help="a 3-node Redis Cluster against redis-py's"
    )
    args = parser.parse_args(argv)
    for name in ("values_kib", "batch", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def timed(fn: Callable[[int], None], rounds: int) -> float:
    start = time.perf_counter()
    for r in range(rounds):
        fn(r)
    return time.perf_counter() - start


def redis_benchmark_argv(port: int, size: int, batch: int, requests: int) -> list[list[str]]:
    """redis-benchmark runs shaped like kvconn's calls: one client, ``-P batch``."""
    base = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "1", "-P", str(batch)]
    return [
        [*base, "-n", str(requests), "-d", str(size), "-t", "set,get", "--csv"],
        # EXISTS of the key the SET test wrote; it moves no payload, so many more requests.
        [*base, "-n", str(requests * 20), "--csv", "EXISTS", "key:__rand_int__"],
    ]


def redis_benchmark(port: int, size: int, batch: int, requests: int) -> dict[str, float]:
    """requests/s of redis-benchmark SET, GET and EXISTS."""
    out: dict[str, float] = {}
    runs = redis_benchmark_argv(port, size, batch, requests)
    for argv in runs:
        text = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
        for row in csv.reader(io.StringIO(text)):
            if len(row) >= 2 and row[0] != "test":
                name = row[0].split()[0].upper()
                out[name] = float(row[1])
    return out


def compare(
    args: argparse.Namespace,
    kv: Backend,
    raw: Any,
    raw_values: Callable[[list[str]], list[Any]],
    flush: Callable[[], None],
    after_repeat: Callable[[Best], None] | None = None,
) -> Best:
    """kvconn and redis-py doing the same batches, interleaved; best ops/s of each.

    ``raw`` is a redis-py client (``Redis`` or ``RedisCluster``: both pipeline alike);
    ``raw_values`` is its fastest way to fetch a batch of values as ``bytes``.
    """
    size, batch, rounds = args.values_kib * 1024, args.batch, args.rounds
    values = [os.urandom(size) for _ in range(batch)]
    buffers = [bytearray(size) for _ in range(batch)]

    def keys(tag: str, r: int) -> list[str]:
        return [f"bench/{tag}/{r}/{i:04d}/page-0123456789abcdef" for i in range(batch)]

    def kv_put(tag: str) -> Callable[[int], None]:
        def run(r: int) -> None:
            ok = kv.put(keys(tag, r), values)
            assert all(ok)

        return run

    def raw_put(tag: str) -> Callable[[int], None]:
        def run(r: int) -> None:
            pipe = raw.pipeline(transaction=False)
            for key, value in zip(keys(tag, r), values):
                pipe.set(key, value, nx=True)
            pipe.execute()

        return run

    fixed = keys("read", 0)

    def kv_get(_r: int) -> None:
        assert all(kv.get(fixed, buffers))

    def raw_get(_r: int) -> None:
        for value, buf in zip(raw_values(fixed), buffers):
            assert isinstance(value, bytes) and len(value) == len(buf)
            buf[:] = value  # the copy kvconn must make too

    def kv_exists(_r: int) -> None:
        assert all(kv.exists(fixed))

    def raw_exists(_r: int) -> None:
        pipe = raw.pipeline(transaction=False)
        for key in fixed:
            pipe.exists(key)
        assert all(pipe.execute())

    best: Best = {}

    def keep(op: str, impl: str, ops_per_s: float) -> None:
        best[(op, impl)] = max(best.get((op, impl), 0.0), ops_per_s)

    exists_rounds = rounds * 20  # exists moves no payload; more rounds for a stable figure
    for rep in range(args.repeats):
        for impl, make in (("kvconn", kv_put), ("redis-py", raw_put)):
            keep("put", impl, rounds * batch / timed(make(f"{impl}-{rep}"), rounds))
            flush()
        kv.put(fixed, values)
        for impl, get_fn, exists_fn in (
            ("kvconn", kv_get, kv_exists),
            ("redis-py", raw_get, raw_exists),
        ):
            keep("get", impl, rounds * batch / timed(get_fn, rounds))
            keep("exists", impl, exists_rounds * batch / timed(exists_fn, exists_rounds))
        assert bytes(buffers[-1]) == values[-1]
        flush()
        if after_repeat is not None:
            after_repeat(best)
    return best


def cell(op: str, ops: float | None, size: int) -> str:
    """One table cell: GB/s and ops/s, or ops/s alone for exists (no payload)."""
    if ops is None:
        return f"{'-':>26}"
    if op == "exists":
        return f"{ops:>15,.0f} ops/s{'':>5}"
    return f"{ops * size / 1e9:>7.2f} GB/s {ops:>9,.0f} ops/s"


def header(args: argparse.Namespace, server_info: Any, redis_py: str) -> str:
    version = next(
        (
            line.split(":", 1)[1].strip()
            for line in _text(server_info).splitlines()
            if line.startswith("redis_version:")
        ),
        "?",
    )
    return (
        f"redis-server {version}, redis-py {redis_py}, {os.cpu_count()} CPUs; "
        f"values {args.values_kib} KiB, batch {args.batch}, {args.rounds} rounds, "
        f"best of {args.repeats}"
    )


def single(args: argparse.Namespace) -> int:
    import redis

    size, batch, rounds = args.values_kib * 1024, args.batch, args.rounds
    problem = RedisServer.available()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    have_rb = shutil.which("redis-benchmark") is not None
    requests = max(rounds * batch, 10 * batch)

    with RedisServer() as server:
        kv = load_backend("redis", server.options)
        raw = redis.Redis(host="127.0.0.1", port=server.port)

        def flush() -> None:
            server.command("FLUSHALL", "SYNC")

        def with_redis_benchmark(best: Best) -> None:
            if not have_rb:
                return
            rb = redis_benchmark(server.port, size, batch, requests)
            for op, name in (("put", "SET"), ("get", "GET"), ("exists", "EXISTS")):
                if name in rb:
                    best[(op, "redis-benchmark")] = max(
                        best.get((op, "redis-benchmark"), 0.0), rb[name]
                    )
            flush()

        best = compare(args, kv, raw, raw.mget, flush, with_redis_benchmark)
        kv.close()
        raw.close()
        info = server.command("INFO", "server")

    print(header(args, info, redis.__version__))
    if have_rb:
        for run in redis_benchmark_argv(0, size, batch, requests):
            print("redis-benchmark " + " ".join(run[5:]))
    else:
        print("redis-benchmark: not found, its column is empty")
    impls = ["kvconn", "redis-py", "redis-benchmark"]
    line = f"{'op':<7}" + "".join(f"{name:>26}" for name in impls)
    print(line + f"{'kvconn/raw':>12}{'kvconn/rb':>11}")
    for op in ("put", "get", "exists"):
        kv_ops = best[(op, "kvconn")]
        ratio_raw = kv_ops / best[(op, "redis-py")]
        rb_ops = best.get((op, "redis-benchmark"))
        ratio_rb = f"{kv_ops / rb_ops:>11.2f}" if rb_ops else f"{'-':>11}"
        cells = "".join(cell(op, best.get((op, impl)), size) for impl in impls)
        print(f"{op:<7}{cells}{ratio_raw:>12.2f}{ratio_rb}")
    return 0


def cluster(args: argparse.Namespace) -> int:
    import redis
    import redis.cluster

    size = args.values_kib * 1024
    problem = RedisCluster.available()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2

    with RedisCluster(3) as servers:
        kv = load_backend("redis", servers.options)
        raw: Any = redis.cluster.RedisCluster(host="127.0.0.1", port=servers.ports[0])

        def raw_values(keys: list[str]) -> list[Any]:
            pipe = raw.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return list(pipe.execute())

        def flush() -> None:
            for node in servers.nodes:
                node.command("FLUSHALL", "SYNC")

        best = compare(args, kv, raw, raw_values, flush)
        kv.close()
        raw.close()
        info = servers.nodes[0].command("INFO", "server")

    print(header(args, info, redis.__version__) + f"; a {len(servers.nodes)}-node cluster")
    impls = ["kvconn", "redis-py"]
    print(f"{'op':<7}" + "".join(f"{name + ' cluster':>26}" for name in impls) + "  kvconn/raw")
    for op in ("put", "get", "exists"):
        ratio = best[(op, "kvconn")] / best[(op, "redis-py")]
        cells = "".join(cell(op, best.get((op, impl)), size) for impl in impls)
        print(f"{op:<7}{cells}{ratio:>12.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cluster(args) if args.cluster else single(args)


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


if __name__ == "__main__":
    sys.exit(main())
