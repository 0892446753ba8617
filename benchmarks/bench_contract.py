"""What the Backend contract's fast paths buy against a real store's ``exists``.

``VettedKeys`` lets a backend skip re-checking keys the connector checked at start-up.
This times ``exists`` of 64 connector-shaped keys on each backend (embedded LMDB, a
local redis-server and Mooncake started here), once with a plain list and once with a
vetted batch, in interleaved trials, and reports medians and the share the check costs.

    python benchmarks/bench_contract.py [--calls 400]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from kvconn.backend import Backend, VettedKeys
from kvconn.registry import load_backend

KEYS = [
    "kvconn/MiniMaxAI%2FMiniMax-M3@rev/w8r3/lg0/t32b131072-0123456789abcdef/"
    + hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()
    for i in range(64)
]


@contextmanager
def backends() -> Iterator[list[tuple[str, Backend]]]:
    from kvconn.tools.devserver.mooncake import MooncakeCluster
    from kvconn.tools.devserver.redis import RedisServer

    with ExitStack() as stack:
        path = stack.enter_context(tempfile.TemporaryDirectory())
        redis = stack.enter_context(RedisServer())
        mooncake = stack.enter_context(MooncakeCluster())
        opened: list[tuple[str, Backend]] = [
            ("lmdb", load_backend("lmdb", {"path": path})),
            ("redis", load_backend("redis", {"url": redis.url})),
            ("mooncake", load_backend("mooncake", mooncake.options)),
        ]
        for _, backend in opened:
            stack.callback(backend.close)
        yield opened


def median_us(backend: Backend, calls: int) -> tuple[float, float]:
    vetted = VettedKeys.unchecked(KEYS, backend.max_key_length)
    backend.put(KEYS[:40], [b"x" * 64] * 40)
    variants: dict[str, Any] = {"plain": KEYS, "vetted": vetted}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(50):
        for keys in variants.values():
            backend.exists(keys)
    names = list(variants)
    for _ in range(calls):
        random.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            backend.exists(variants[name])
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["plain"]) * 1e6, statistics.median(times["vetted"]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=400, help="interleaved trials per backend")
    args = parser.parse_args()
    print(f"exists of {len(KEYS)} keys, medians of {args.calls} interleaved calls")
    print(f"{'backend':>9} {'plain list µs':>14} {'vetted µs':>10} {'check share':>12}")
    with backends() as opened:
        for name, backend in opened:
            plain, vetted = median_us(backend, args.calls)
            print(f"{name:>9} {plain:14.1f} {vetted:10.1f} {(plain - vetted) / plain:12.1%}")


if __name__ == "__main__":
    main()
