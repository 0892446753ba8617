"""How many keys one Mooncake call may move over TCP, and what a page in pieces costs.

Two measurements over one cluster (a master and a standalone storage process, loopback
TCP, as kvconn's default deployment):

* ``queue`` - ``--keys`` values of ``--value-kib`` KiB put and read back in one batch:
  kvconn's backend, which cuts the batch into slices within the transport's queue
  (``kvconn_mooncake._flight``), against the bare client's single call. Mooncake's TCP
  transport queues 1,024 requests per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``),
  holds as many more for a second and rejects the rest, so the bare call past 2,048
  keys loses values (its put waits out a 60 s transfer timeout first). Prints each
  side's time and how many values landed.
* ``pool`` - the ``--pages`` pages of one prompt, each ``--layers`` layers of K and V
  (``--piece-kib`` KiB each, vLLM's CPU layout at the issue's geometry) plus the 8-byte
  checksum trailer: read as whole values into staging and then scattered into
  per-layer buffers (what kvconn does), against Mooncake reading each value straight
  into its pieces (``batch_get_into_multi_buffers``, what vLLM's
  ``MooncakeStoreConnector`` does); and the same for puts. Trials interleaved; medians
  and the ratio of direct to staged. The direct calls go ``--direct-keys`` keys at a
  time, since every piece is a request of its own in the queue above.

The pool is measured first: after the bare client's call overflowed the queue, its
transfers to that storage process kept failing (``-800``); the last line says whether
one more put of each client works.

Usage: ``python -m benchmarks.bench_mooncake_slices [--skip-bare-queue]``
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

import numpy as np

from kvconn.backend import VettedKeys
from kvconn.registry import load_backend
from kvconn.tools.devserver.mooncake import MooncakeCluster, ready_to_benchmark

MiB = 2**20
TRAILER = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=3000, help="values in the queue batch")
    parser.add_argument("--value-kib", type=int, default=16, help="queue value size (16)")
    parser.add_argument(
        "--skip-bare-queue",
        action="store_true",
        help="skip the bare client's whole-batch call (its put waits ~60 s)",
    )
    parser.add_argument("--pages", type=int, default=63, help="pages of the prompt (63)")
    parser.add_argument("--layers", type=int, default=24, help="layers per page (24)")
    parser.add_argument("--piece-kib", type=int, default=16, help="K or V of a layer (16)")
    parser.add_argument("--direct-keys", type=int, default=8, help="keys per direct call (8)")
    parser.add_argument("--trials", type=int, default=15, help="interleaved trials (15)")
    return parser.parse_args(argv)


def address(array: np.ndarray | bytearray) -> int:
    if isinstance(array, bytearray):
        return ctypes.addressof((ctypes.c_char * len(array)).from_buffer(array))
    return int(array.ctypes.data)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def queue(kv: Any, args: argparse.Namespace, raw: Any) -> list[str]:
    n, size = args.keys, args.value_kib * 1024
    lines = [f"queue: {n} values of {args.value_kib} KiB in one batch"]
    try:
        source = bytearray(os.urandom(n * size))
        landing = bytearray(n * size)
        kv.register_buffer(memoryview(source))
        kv.register_buffer(memoryview(landing))
        keys = VettedKeys.unchecked([f"q/kv/{i:06d}" for i in range(n)], kv.max_key_length)
        pages = [memoryview(source)[i * size : (i + 1) * size] for i in range(n)]
        into = [memoryview(landing)[i * size : (i + 1) * size] for i in range(n)]
        put_s, stored = timed(lambda: kv.put(keys, pages))
        get_s, loaded = timed(lambda: kv.get(keys, into, scratch=True))
        same = landing == source
        lines.append(
            f"  kvconn (slices of {kv.config.transfers_in_flight}): put {put_s:8.3f} s, "
            f"{sum(stored)} stored; get {get_s:6.3f} s, {sum(loaded)} loaded, bytes equal {same}"
        )
        if not args.skip_bare_queue:
            for array in (source, landing):
                assert raw.register_buffer(address(array), len(array)) == 0
            bare = [f"q/raw/{i:06d}" for i in range(n)]
            sizes = [size] * n
            put_s, codes = timed(
                lambda: raw.batch_put_from(
                    bare, [address(source) + i * size for i in range(n)], sizes
                )
            )
            get_s, lengths = timed(
                lambda: raw.batch_get_into(
                    bare, [address(landing) + i * size for i in range(n)], sizes
                )
            )
            lines.append(
                f"  bare client, one call:   put {put_s:8.3f} s, {codes.count(0)} stored; "
                f"get {get_s:6.3f} s, {lengths.count(size)} loaded"
            )
            after = [f"q/after/{i}" for i in range(2)]
            bare_after = raw.batch_put_from(after[:1], [address(source)], [size])
            kv_after = kv.put(after[1:], pages[:1])
            lines.append(f"  then one more put each: bare client {bare_after}, kvconn {kv_after}")
            for array in (source, landing):
                raw.unregister_buffer(address(array))
    finally:
        kv.unregister_buffer(memoryview(source))
        kv.unregister_buffer(memoryview(landing))
    return lines


def pool(args: argparse.Namespace, raw: Any) -> list[str]:
    pages, pieces, piece = args.pages, 2 * args.layers, args.piece_kib * 1024
    value = pieces * piece + TRAILER
    slots = 4 * pages  # the pool holds more blocks than the prompt; its pages land scattered
    source = np.frombuffer(os.urandom(pages * value), np.uint8).copy()
    staging = np.zeros(pages * value, np.uint8)
    layers = [np.zeros(slots * piece, np.uint8) for _ in range(pieces)]
    trailers = np.zeros(pages * TRAILER, np.uint8)
    for array in (source, staging, trailers, *layers):
        assert raw.register_buffer(address(array), array.nbytes) == 0
    keys = [f"p/{i:04d}" for i in range(pages)]
    put = raw.batch_put_from(
        keys, [address(source) + i * value for i in range(pages)], [value] * pages
    )
    assert put == [0] * pages, sorted(set(put))
    where = random.Random(0).sample(range(slots), pages)
    piece_ptrs = [
        [address(layer) + slot * piece for layer in layers] + [address(trailers) + i * TRAILER]
        for i, slot in enumerate(where)
    ]
    piece_sizes = [[piece] * pieces + [TRAILER]] * pages
    rows = staging.reshape(pages, value)
    step = args.direct_keys

    def staged_get() -> None:
        got = raw.batch_get_into(
            keys, [address(staging) + i * value for i in range(pages)], [value] * pages
        )
        assert got == [value] * pages, got[:3]
        for i, slot in enumerate(where):
            for j, layer in enumerate(layers):
                layer[slot * piece : (slot + 1) * piece] = rows[i, j * piece : (j + 1) * piece]

    def direct_get() -> None:
        for a in range(0, pages, step):
            got = raw.batch_get_into_multi_buffers(
                keys[a : a + step], piece_ptrs[a : a + step], piece_sizes[a : a + step]
            )
            assert got == [value] * len(got), got[:3]

    saved = [f"s/{i:04d}" for i in range(pages)]

    def staged_put() -> None:
        raw.batch_remove(saved, True)
        for i, slot in enumerate(where):
            for j, layer in enumerate(layers):
                rows[i, j * piece : (j + 1) * piece] = layer[slot * piece : (slot + 1) * piece]
        done = raw.batch_put_from(
            saved, [address(staging) + i * value for i in range(pages)], [value] * pages
        )
        assert done == [0] * pages, done[:3]

    def direct_put() -> None:
        raw.batch_remove(saved, True)
        for a in range(0, pages, step):
            done = raw.batch_put_from_multi_buffers(
                saved[a : a + step], piece_ptrs[a : a + step], piece_sizes[a : a + step]
            )
            assert done == [0] * len(done), done[:3]

    variants = {
        "get, staged + scatter": staged_get,
        "get, direct into pieces": direct_get,
        "put, gather + staged": staged_put,
        "put, direct from pieces": direct_put,
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.trials):
        for name in random.sample(list(variants), len(variants)):
            samples[name].append(timed(variants[name])[0])
    direct_get()
    for i, slot in enumerate(where):  # the direct read put every piece where it belongs
        for j, layer in enumerate(layers):
            expect = source[i * value + j * piece : i * value + (j + 1) * piece]
            assert (layer[slot * piece : (slot + 1) * piece] == expect).all()
    median = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
    get_ratio = median["get, direct into pieces"] / median["get, staged + scatter"]
    put_ratio = median["put, direct from pieces"] / median["put, gather + staged"]
    lines = [
        f"pool: {pages} pages of {pieces} pieces of {args.piece_kib} KiB "
        f"({pages * value / MiB:.1f} MiB), medians of {args.trials} trials",
        *(f"  {name:26s} {ms:8.2f} ms" for name, ms in median.items()),
        f"  direct / staged: get {get_ratio:.2f}, put {put_ratio:.2f}",
    ]
    raw.batch_remove(keys + saved, True)
    for array in (source, staging, trailers, *layers):
        raw.unregister_buffer(address(array))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not ready_to_benchmark():
        return 2
    room = 2 * args.keys * args.value_kib * 1024 + 4 * args.pages * 2 * args.layers * (
        args.piece_kib * 1024 + TRAILER
    )
    with MooncakeCluster(storage_processes=1, segment_size=room + 64 * MiB) as cluster:
        kv: Any = load_backend("mooncake", {**cluster.options, "read_env": False})  # first:
        raw: Any = cluster.client()  # it loads Mooncake with INFO logs off
        try:
            lines = pool(args, raw) + queue(kv, args, raw)  # the pool first: see docstring
        finally:
            raw.close()
            kv.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
