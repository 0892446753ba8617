"""Batched put/get/exists throughput: kvconn's Mooncake backend vs the raw Mooncake client.

Three columns, same batches, measured side by side: each of ``--trials`` trials times
one batch of every implementation in a shuffled order (``exists``: ``--exists-calls``
calls each), so a noisy neighbour slows all of them alike. Throughput is the batch
over the median time; ``kvconn/raw`` is the ratio of the medians, with the 25th-75th
percentiles of the per-trial paired ratios beside it:

* ``kvconn`` - :class:`kvconn_mooncake.MooncakeBackend` with its buffers registered, as
  the connector uses it (``batch_put_from`` / ``batch_get_into`` into staging, which the
  connector declares scratch / ``batch_is_exist``);
* ``raw zero-copy`` - a bare ``MooncakeDistributedStore`` making the same zero-copy
  calls on registered memory, without kvconn's checks: the ceiling kvconn can reach;
* ``raw copying`` - Mooncake's copying API (``put_batch`` of bytes, ``get_batch`` plus
  the copy into caller buffers that the contract requires).

``kvconn`` passes its keys as the connector does, in a :class:`kvconn.backend.VettedKeys`
batch (checked once at start-up); the ``exists (list)`` row passes a plain list, which
the backend checks on every call, as it must for any other caller. The ``get (checked)``
row reads without ``scratch=True``, as any other caller does: sizes are asked first
(one ``batch_get_replica_desc``) so a buffer of the wrong size stays untouched.

``kvconn/raw`` is the cost of kvconn's layer (target >= 0.95); ``zero-copy/copying`` is
what registration buys (target >= 3x). ``--storage process`` keeps the data in a
standalone ``mooncake_client`` process (the deployment kvconn defaults to; every byte
crosses loopback TCP); ``--storage embedded`` mounts the segment in this process, as
Mooncake's "embedded" mode does, so transfers are local copies.

Usage: ``python benchmarks/bench_mooncake.py [--storage process|embedded] [--value-kib 1024]``
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from kvconn.backend import VettedKeys
from kvconn.registry import load_backend
from kvconn.tools.devserver.mooncake import MooncakeCluster, ready_to_benchmark

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--value-kib", type=int, default=1024, help="value size in KiB (1024)")
    parser.add_argument("--batch", type=int, default=64, help="keys per batched call (64)")
    parser.add_argument("--trials", type=int, default=40, help="interleaved trials (40)")
    parser.add_argument(
        "--exists-calls", type=int, default=20, help="exists calls per trial and variant (20)"
    )
    parser.add_argument(
        "--storage",
        choices=("process", "embedded"),
        default="process",
        help="where the segment lives: a mooncake_client process (default) or this process",
    )
    args = parser.parse_args(argv)
    for name in ("value_kib", "batch", "trials", "exists_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def address(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


Variants = dict[str, Callable[[], None]]


def interleaved(variants: Variants, calls: int, samples: dict[str, list[float]]) -> None:
    """Time ``calls`` calls of each variant, in a new shuffled order for every call."""
    order = list(variants.items())
    clock = time.perf_counter
    for _ in range(calls):
        random.shuffle(order)
        for name, fn in order:
            start = clock()
            fn()
            samples[name].append(clock() - start)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready_to_benchmark():
        return 2
    size, batch = args.value_kib * 1024, args.batch
    span = size * batch
    # Room for one trial: the read set plus three puts, with slack so eviction (which
    # starts at 90 %) never runs during a measurement.
    segment = max(16 * MiB, 6 * span)
    embedded = args.storage == "embedded"

    with MooncakeCluster(storage_processes=0 if embedded else 1, segment_size=segment) as cluster:
        options = {**cluster.options, "read_env": False}
        kv: Any = load_backend("mooncake", options)  # first: loads Mooncake with INFO logs off
        host = cluster.client(segment_size=segment) if embedded else None
        raw: Any = cluster.client()
        copying: Any = cluster.client(local_buffer_size=2 * span + 16 * MiB)

        payload = os.urandom(span)
        kv_src, kv_dst = bytearray(payload), bytearray(span)
        raw_src, raw_dst = bytearray(payload), bytearray(span)
        kv.register_buffer(memoryview(kv_src))
        kv.register_buffer(memoryview(kv_dst))
        for arena in (raw_src, raw_dst):
            assert raw.register_buffer(address(arena), span) == 0
        kv_src_views = [memoryview(kv_src)[i * size : (i + 1) * size] for i in range(batch)]
        kv_dst_views = [memoryview(kv_dst)[i * size : (i + 1) * size] for i in range(batch)]
        raw_src_ptrs = [address(raw_src) + i * size for i in range(batch)]
        raw_dst_ptrs = [address(raw_dst) + i * size for i in range(batch)]
        sizes = [size] * batch
        values = [payload[i * size : (i + 1) * size] for i in range(batch)]
        copy_dst = [bytearray(size) for _ in range(batch)]
        limit = kv.max_key_length

        def keys(tag: str) -> list[str]:
            return [f"bench/{tag}/{i:04d}/page-0123456789abcdef" for i in range(batch)]

        fixed = keys("read")
        vetted = VettedKeys.unchecked(fixed, limit)

        def put_variants(trial: int) -> Variants:
            kv_keys = VettedKeys.unchecked(keys(f"kv{trial}"), limit)
            raw_keys, copy_keys = keys(f"raw{trial}"), keys(f"copy{trial}")

            def kv_put() -> None:
                assert all(kv.put(kv_keys, kv_src_views))

            def raw_put() -> None:
                assert raw.batch_put_from(raw_keys, raw_src_ptrs, sizes) == [0] * batch

            def copy_put() -> None:
                assert copying.put_batch(copy_keys, values) == 0

            return {"kvconn": kv_put, "raw zero-copy": raw_put, "raw copying": copy_put}

        def kv_get() -> None:
            assert all(kv.get(vetted, kv_dst_views, scratch=True))

        def kv_get_checked() -> None:
            assert all(kv.get(vetted, kv_dst_views))

        def raw_get() -> None:
            assert raw.batch_get_into(fixed, raw_dst_ptrs, sizes) == sizes

        def copy_get() -> None:
            for value, buf in zip(copying.get_batch(fixed), copy_dst):
                assert len(value) == size
                buf[:] = value  # into the caller's buffer, as the contract requires

        def kv_exists() -> None:
            assert all(kv.exists(vetted))

        def kv_exists_list() -> None:
            assert all(kv.exists(fixed))

        def raw_exists() -> None:
            assert raw.batch_is_exist(fixed) == [1] * batch

        gets: Variants = {
            "get/kvconn": kv_get,
            "get (checked)/kvconn": kv_get_checked,
            "get/raw zero-copy": raw_get,
            "get/raw copying": copy_get,
        }
        lookups: Variants = {
            "exists/kvconn": kv_exists,
            "exists (list)/kvconn": kv_exists_list,
            "exists/raw zero-copy": raw_exists,
        }
        samples: dict[str, list[float]] = {
            name: [] for name in [*(f"put/{impl}" for impl in put_variants(0)), *gets, *lookups]
        }
        for trial in range(args.trials):
            raw.remove_all(True)  # the puts start from the same state every trial
            assert all(kv.put(vetted, kv_src_views))
            puts = {f"put/{impl}": fn for impl, fn in put_variants(trial).items()}
            interleaved(puts, 1, samples)
            interleaved(gets, 1, samples)
            interleaved(lookups, args.exists_calls, samples)
        assert kv_dst == payload and raw_dst == payload
        assert b"".join(copy_dst) == payload
        counters = dict(kv.counters)
        raw.remove_all(True)
        kv.close()
        for client in (raw, copying, host):
            if client is not None:
                client.close()

    from importlib.metadata import version

    print(
        f"mooncake-transfer-engine {_mooncake_version(version)}, {os.cpu_count()} CPUs; "
        f"storage {args.storage}; values {args.value_kib} KiB, batch {batch}, "
        f"{args.trials} interleaved trials ({args.exists_calls} exists calls each)"
    )
    print(
        f"kvconn path counters: put_zero_copy={counters.get('put_zero_copy', 0)} "
        f"put_scratch={counters.get('put_scratch', 0)} "
        f"get_zero_copy={counters.get('get_zero_copy', 0)} "
        f"get_scratch={counters.get('get_scratch', 0)}"
    )
    print(report(samples, size, batch))
    return 0


def report(samples: dict[str, list[float]], size: int, batch: int) -> str:
    """The table: median throughput per implementation and the ratios between them."""
    impls = ["kvconn", "raw zero-copy", "raw copying"]
    lines = [
        f"{'op':<14}"
        + "".join(f"{name:>24}" for name in impls)
        + f"{'kvconn/raw [p25-p75]':>24}{'zero-copy/copying':>19}"
    ]
    for op in ("put", "get", "get (checked)", "exists", "exists (list)"):
        base = op.split(" ")[0]
        cells = []
        for impl in impls:
            times = samples.get(f"{op}/{impl}") or samples.get(f"{base}/{impl}")
            if not times or (impl != "kvconn" and op != base):
                cells.append(f"{'-':>24}")
                continue
            ops = batch / statistics.median(times)
            if base == "exists":
                cells.append(f"{ops:>17,.0f} keys/s")
            else:
                cells.append(f"{ops * size / 1e9:>8.2f} GB/s {ops:>7,.0f}/s")
        kv_times, raw_times = samples[f"{op}/kvconn"], samples[f"{base}/raw zero-copy"]
        ratio = statistics.median(raw_times) / statistics.median(kv_times)
        paired = sorted(r / k for r, k in zip(raw_times, kv_times))
        spread = f"{paired[len(paired) // 4]:.2f}-{paired[(3 * len(paired)) // 4]:.2f}"
        copy_times = samples.get(f"{op}/raw copying")
        gain = (
            f"{statistics.median(copy_times) / statistics.median(raw_times):>18.2f}x"
            if copy_times
            else f"{'-':>19}"
        )
        lines.append(f"{op:<14}" + "".join(cells) + f"{ratio:>12.2f} [{spread}]" + gain)
    return "\n".join(lines)


def _mooncake_version(version: Callable[[str], str]) -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return version(dist)
        except Exception:
            continue
    return "?"


if __name__ == "__main__":
    sys.exit(main())
