"""Where the time of one batched ``exists`` goes: raw client, a minimal wrapper, kvconn.

``bench_mooncake.py`` reports throughput; this one times single calls, interleaved in a
shuffled order so no variant always runs right after another (which hides cold-cache
costs), and reports the 10th and 50th percentiles in µs:

* ``raw`` - ``MooncakeDistributedStore.batch_is_exist`` on a bare client;
* ``minimal wrapper`` - the least any correct integration does around it: copy the key
  list, take a lock, reject negative codes, turn the codes into bools;
* ``kvconn`` - ``MooncakeBackend.exists`` with a ``VettedKeys`` batch, as the connector
  calls it;
* ``kvconn (list)`` - the same with a plain list, checked on every call.

Then kvconn's own work alone: ``MooncakeBackend.exists`` over a stub client that
answers at once, timed in a tight loop (caches warm) and right after a real RPC (as it
runs in practice: caches cold, the client's I/O threads still busy).

Usage: ``python benchmarks/bench_mooncake_exists.py [--keys 64] [--calls 3000] [--no-gc]``
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvconn.backend import VettedKeys
from kvconn.registry import load_backend
from kvconn.tools.devserver.mooncake import MooncakeCluster, ready_to_benchmark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=64, help="keys per call (64)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per variant (3000)")
    parser.add_argument("--no-gc", action="store_true", help="disable the garbage collector")
    args = parser.parse_args(argv)
    if args.keys < 1 or args.calls < 10:
        parser.error("--keys must be >= 1 and --calls >= 10")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready_to_benchmark():
        return 2
    with MooncakeCluster(storage_processes=1, segment_size=64 * 2**20) as cluster:
        options: dict[str, Any] = {**cluster.options, "read_env": False}
        kv: Any = load_backend("mooncake", options)
        raw: Any = cluster.client()
        keys = [f"bench/exists/{i:05d}/page-0123456789abcdef" for i in range(args.keys)]
        assert all(kv.put(keys, [b"x" * 1024] * len(keys)))
        limit = kv.max_key_length
        lock = threading.Lock()

        def minimal() -> list[bool]:
            with lock:
                pass
            codes = raw.batch_is_exist(list(keys))
            if min(codes) < 0:
                raise RuntimeError(codes)
            with lock:
                pass
            return list(map(bool, codes))

        variants: dict[str, Callable[[], object]] = {
            "raw": lambda: raw.batch_is_exist(keys),
            "minimal wrapper": minimal,
            "kvconn": lambda: kv.exists(VettedKeys.unchecked(keys, limit)),
            "kvconn (list)": lambda: kv.exists(keys),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        if args.no_gc:
            gc.disable()
        clock = time.perf_counter
        order = list(variants.items())
        for _ in range(args.calls):
            random.shuffle(order)
            for name, call in order:
                start = clock()
                call()
                samples[name].append(clock() - start)
        gc.enable()
        hot, after_rpc = own_work(kv, raw, keys, limit, args.calls)
        kv.close()
        raw.close()

    print(
        f"{os.cpu_count()} CPUs; {args.keys} keys per call, {args.calls} calls per variant, "
        f"shuffled; gc {'off' if args.no_gc else 'on'}"
    )
    base = sorted(samples["raw"])
    print(f"{'variant':<18}{'p10 µs':>10}{'p50 µs':>10}{'raw/p10':>10}{'raw/p50':>10}")
    for name, times in samples.items():
        times.sort()
        p10, p50 = times[len(times) // 10], times[len(times) // 2]
        ratio10, ratio50 = base[len(base) // 10] / p10, base[len(base) // 2] / p50
        print(f"{name:<18}{p10 * 1e6:>10.1f}{p50 * 1e6:>10.1f}{ratio10:>10.2f}{ratio50:>10.2f}")
    print(
        f"kvconn's own work over a stub client, p50: {hot * 1e6:.1f} µs in a tight loop, "
        f"{after_rpc * 1e6:.1f} µs right after a real RPC"
    )
    return 0


def own_work(kv: Any, raw: Any, keys: list[str], limit: int, calls: int) -> tuple[float, float]:
    """Median time of ``kv.exists`` over a client that answers at once: hot, after an RPC."""
    answer = raw.batch_is_exist(keys)

    class Stub:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def batch_is_exist(self, _keys: list[str]) -> list[int]:
            return list(answer)

    batch = VettedKeys.unchecked(keys, limit)
    real, stub = kv._session.store, Stub()
    clock = time.perf_counter
    hot: list[float] = []
    cold: list[float] = []
    try:
        kv._session.store = stub
        for _ in range(calls):
            start = clock()
            kv.exists(batch)
            hot.append(clock() - start)
        for _ in range(calls):
            raw.batch_is_exist(keys)
            start = clock()
            kv.exists(batch)
            cold.append(clock() - start)
    finally:
        kv._session.store = real
    return statistics.median(hot), statistics.median(cold)


if __name__ == "__main__":
    sys.exit(main())
