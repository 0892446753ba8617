"""Batched put/get/exists throughput: kvconn's Mooncake backend vs the raw Mooncake client.

Three columns, same batches, interleaved in one run (best of ``--repeats``, because a
shared machine is noisy):

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
import sys
import time
from collections.abc import Callable
from typing import Any

from kvconn.backend import VettedKeys
from kvconn.devserver.mooncake import MooncakeCluster
from kvconn.registry import load_backend

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--value-kib", type=int, default=1024, help="value size in KiB (1024)")
    parser.add_argument("--batch", type=int, default=64, help="keys per batched call (64)")
    parser.add_argument("--rounds", type=int, default=8, help="batches per measurement (8)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats, best kept (5)")
    parser.add_argument(
        "--storage",
        choices=("process", "embedded"),
        default="process",
        help="where the segment lives: a mooncake_client process (default) or this process",
    )
    args = parser.parse_args(argv)
    for name in ("value_kib", "batch", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def address(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def timed(fn: Callable[[int], None], rounds: int) -> float:
    start = time.perf_counter()
    for r in range(rounds):
        fn(r)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # keep transfers on loopback
    problem = MooncakeCluster.available()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    size, batch, rounds = args.value_kib * 1024, args.batch, args.rounds
    span = size * batch
    # Room for one measurement's distinct puts plus the fixed read set, with slack so
    # eviction (which starts at 90 %) never runs during a measurement.
    segment = max(16 * MiB, 2 * span * (rounds + 1))
    embedded = args.storage == "embedded"

    with MooncakeCluster(storage_processes=0 if embedded else 1, segment_size=segment) as cluster:
        options = {**cluster.options, "read_env": False}
        host = cluster.client(segment_size=segment) if embedded else None
        kv: Any = load_backend("mooncake", options)
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

        def keys(tag: str, r: int) -> list[str]:
            return [f"bench/{tag}/{r}/{i:04d}/page-0123456789abcdef" for i in range(batch)]

        def clear() -> None:
            raw.remove_all(True)

        limit = kv.max_key_length

        def kv_put(tag: str) -> Callable[[int], None]:
            def run(r: int) -> None:
                assert all(kv.put(VettedKeys.unchecked(keys(tag, r), limit), kv_src_views))

            return run

        def raw_put(tag: str) -> Callable[[int], None]:
            def run(r: int) -> None:
                assert raw.batch_put_from(keys(tag, r), raw_src_ptrs, sizes) == [0] * batch

            return run

        def copy_put(tag: str) -> Callable[[int], None]:
            def run(r: int) -> None:
                assert copying.put_batch(keys(tag, r), values) == 0

            return run

        fixed = keys("read", 0)

        def kv_get(_r: int) -> None:
            assert all(kv.get(VettedKeys.unchecked(fixed, limit), kv_dst_views, scratch=True))

        def kv_get_checked(_r: int) -> None:
            assert all(kv.get(VettedKeys.unchecked(fixed, limit), kv_dst_views))

        def raw_get(_r: int) -> None:
            assert raw.batch_get_into(fixed, raw_dst_ptrs, sizes) == sizes

        def copy_get(_r: int) -> None:
            for value, buf in zip(copying.get_batch(fixed), copy_dst):
                assert len(value) == size
                buf[:] = value  # into the caller's buffer, as the contract requires

        def kv_exists(_r: int) -> None:
            assert all(kv.exists(VettedKeys.unchecked(fixed, limit)))

        def kv_exists_list(_r: int) -> None:
            assert all(kv.exists(fixed))

        def raw_exists(_r: int) -> None:
            assert raw.batch_is_exist(fixed) == [1] * batch

        best: dict[tuple[str, str], float] = {}

        def keep(op: str, impl: str, ops_per_s: float) -> None:
            best[(op, impl)] = max(best.get((op, impl), 0.0), ops_per_s)

        exists_rounds = rounds * 20  # no payload: more rounds for a stable figure
        puts = (("kvconn", kv_put), ("raw zero-copy", raw_put), ("raw copying", copy_put))
        gets = (("kvconn", kv_get), ("raw zero-copy", raw_get), ("raw copying", copy_get))
        gets_checked = (("kvconn", kv_get_checked), ("raw zero-copy", raw_get))
        exists = (("kvconn", kv_exists), ("raw zero-copy", raw_exists))
        exists_list = (("kvconn", kv_exists_list), ("raw zero-copy", raw_exists))
        for rep in range(args.repeats):
            # Rotate who goes first: the first measurement after a clear() runs slower.
            for impl, make in puts[rep % 3 :] + puts[: rep % 3]:
                clear()
                keep("put", impl, rounds * batch / timed(make(f"{impl}-{rep}"), rounds))
            clear()
            assert all(kv.put(fixed, kv_src_views))
            for impl, fn in gets[rep % 3 :] + gets[: rep % 3]:
                keep("get", impl, rounds * batch / timed(fn, rounds))
            for impl, fn in gets_checked[rep % 2 :] + gets_checked[: rep % 2]:
                keep("get (checked)", impl, rounds * batch / timed(fn, rounds))
            for op, pair in (("exists", exists), ("exists (list)", exists_list)):
                for impl, fn in pair[rep % 2 :] + pair[: rep % 2]:
                    keep(op, impl, exists_rounds * batch / timed(fn, exists_rounds))
        assert kv_dst == payload and raw_dst == payload
        assert b"".join(copy_dst) == payload
        zero_copy = dict(kv.counters)
        clear()
        kv.close()
        for client in (raw, copying, host):
            if client is not None:
                client.close()

    from importlib.metadata import version

    print(
        f"mooncake-transfer-engine {_mooncake_version(version)}, {os.cpu_count()} CPUs; "
        f"storage {args.storage}; values {args.value_kib} KiB, batch {batch}, "
        f"{rounds} rounds, best of {args.repeats}"
    )
    print(
        f"kvconn path counters: put_zero_copy={zero_copy.get('put_zero_copy', 0)} "
        f"put_scratch={zero_copy.get('put_scratch', 0)} "
        f"get_zero_copy={zero_copy.get('get_zero_copy', 0)} "
        f"get_scratch={zero_copy.get('get_scratch', 0)}"
    )
    impls = ["kvconn", "raw zero-copy", "raw copying"]
    header = f"{'op':<14}" + "".join(f"{name:>26}" for name in impls)
    header += f"{'kvconn/raw':>12}{'zero-copy/copying':>19}"
    print(header)
    for op in ("put", "get", "get (checked)", "exists", "exists (list)"):
        cells = []
        for impl in impls:
            ops = best.get((op, impl))
            if ops is None:
                cells.append(f"{'-':>26}")
            elif op.startswith("exists"):
                cells.append(f"{ops:>15,.0f} ops/s{'':>5}")
            else:
                cells.append(f"{ops * size / 1e9:>7.2f} GB/s {ops:>9,.0f} ops/s")
        ratio = best[(op, "kvconn")] / best[(op, "raw zero-copy")]
        copying_ops = best.get((op, "raw copying"))
        gain = (
            f"{best[(op, 'raw zero-copy')] / copying_ops:>18.2f}x" if copying_ops else f"{'-':>19}"
        )
        print(f"{op:<14}" + "".join(cells) + f"{ratio:>12.2f}" + gain)
    return 0


def _mooncake_version(version: Callable[[str], str]) -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return version(dist)
        except Exception:
            continue
    return "?"


if __name__ == "__main__":
    sys.exit(main())
