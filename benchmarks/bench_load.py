"""A connector's whole load from LMDB or Redis, as copies of its bytes, outside any engine.

The geometry is the vLLM benchmark's (``bench_engine_vllm.py``): Qwen2.5-0.5B's 24
layers in vLLM's CPU layout, one pool per layer holding K and V of a block as one 32 KiB
piece, and a 2,048-token hit of 63 blocks (63 pages of 768 KiB, 47 MiB). The load is
``Connector.load`` as an engine's load thread calls it (keys, the store's read, every
page's checksum, the scatter into the 24 pools); the baseline is a ``memcpy`` of
the same payload bytes between two buffers touched beforehand. Every trial times each
variant once, in a new shuffled order; the figures are medians, the ratio is of medians.

The default store is LMDB, whose read is one read transaction lending pages from its
map. ``--backend redis`` loads from a ``redis-server`` on loopback that the benchmark
starts and stops: one ``MGET`` per chunk, whose replies redis-py parses into ``bytes``
that the backend lends the same way. Against Redis two more baselines run in the same
trials, to tell the store's part of a load from kvconn's: ``wire``, the same values as
one ``MGET`` reply read raw off a socket into one buffer, unparsed (the server's send
and the kernel's copies: the floor of any Redis client), and ``redis-py``, redis-py's
``mget`` of them with hiredis and the backend's 1 MiB reads (the parse, without
kvconn's checksum and scatter). ``--backend mooncake`` loads from a Mooncake
cluster on loopback TCP that the benchmark starts (a master and one storage process):
Mooncake lends nothing, so its pages come into the connector's registered staging and
are verified and scattered from there. Against Mooncake one more baseline runs in the
same trials: ``get``, the backend's read of the same pages into one registered buffer
(one ``batch_get_into``; ``bench_mooncake.py`` holds the backend against the bare
client), the load without its checksum and scatter.

``--contend`` repeats it with a thread that keeps running Python, letting the GIL go
only every thousand iterations, as an engine's step loop does between its calls: a load
that gives up the GIL for each copy must win it back each time, so this shows how much a
load depends on the rest of the process (inside vLLM, the load work is measured by
``bench_engine_vllm.py``'s ``inside`` figure). ``--hog`` repeats it with a thread that
never lets the GIL go by itself, only when the interpreter makes it (every
``sys.getswitchinterval()``, 5 ms): the worst an engine's thread can do to a load, each
of whose releases of the GIL (a socket read, a page's checksum, its scatter) then costs
up to that interval.

Run from the repository root:

    python -m benchmarks.bench_load
    python -m benchmarks.bench_load --blocks 63 --trials 31 --contend
    python -m benchmarks.bench_load --kv-heads 1     # a rank's share at TP=2
    python -m benchmarks.bench_load --backend redis --contend
    python -m benchmarks.bench_load --backend redis --hog --trials 7
    python -m benchmarks.bench_load --backend mooncake --contend --hog --trials 9
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable

import redis
import torch

from benchmarks.bench_movement import interleaved_medians
from kvconn import Connector
from kvconn.layout import KvLayout, LayerGroup, Region, Role
from kvconn.tools.devserver.mooncake import MooncakeCluster, keep_transfers_on_loopback
from kvconn.tools.devserver.redis import RedisServer

LAYERS = 24
KV_HEADS = 2
TOKENS = 32
HEAD_DIM = 64


def build(
    path: str,
    blocks: int,
    kv_heads: int = KV_HEADS,
    backend: tuple[str, dict[str, object]] | None = None,
) -> tuple[Connector, list[bytes], list[int]]:
    """A connector over one pool per layer (``[slots, K/V, heads, tokens, dim]`` fp32),
    with ``blocks`` blocks saved; the hashes, and the slots a load fills.

    ``backend`` is a backend's name and options; by default LMDB at ``path``."""
    slots = 2 * blocks + 8
    pools = [torch.randn(slots, 2, kv_heads, TOKENS, HEAD_DIM) for _ in range(LAYERS)]
    regions = tuple(Region.from_tensor("kv", i, p, p, i) for i, p in enumerate(pools))
    layout = KvLayout(
        1,
        TOKENS,
        (Role("kv", kv_heads, "float32+CPU_ATTN"),),
        (LayerGroup(0, slots, regions),),
        tuple(p.numel() * p.element_size() for p in pools),
    )
    name, options = backend if backend is not None else ("lmdb", {"path": path})
    config = {"model": "bench-load", "backend": name, "options": options}
    conn = Connector(config, layout, pools=[p.view(-1).view(torch.uint8) for p in pools])
    hashes = [i.to_bytes(16, "little") for i in range(1, blocks + 1)]
    if conn.save(hashes, list(range(blocks))).written != blocks:
        raise SystemExit("the save did not write every block")
    return conn, hashes, list(range(blocks + 4, 2 * blocks + 4))


def mooncake_baseline(conn: Connector, hashes: list[bytes]) -> dict[str, Callable[[], object]]:
    """``get`` (see the module's docstring): the store's read of the pages ``conn``
    loads, through the same backend, into one registered buffer."""
    keys = [key for h in hashes for key in conn.keys.rank_keys(conn.rank, h)]
    sizes = [share.plan.value_size for h in hashes for share in conn.shares]
    buffer = memoryview(bytearray(sum(sizes)))
    backend = conn.backend
    backend.register_buffer(buffer)  # until the connector closes its backend
    offsets = list(itertools.accumulate([0, *sizes]))
    views = [buffer[a:b] for a, b in itertools.pairwise(offsets)]

    def get() -> None:
        if not all(backend.get(keys, views, scratch=True)):
            raise SystemExit("the store's get did not read every page")

    return {"get": get}


def redis_baselines(
    server: RedisServer, blocks: int, page_bytes: int, stack: contextlib.ExitStack
) -> dict[str, Callable[[], object]]:
    """``wire`` and ``redis-py`` (see the module's docstring) over the stored pages.

    The pages are the server's values of at least ``page_bytes`` (a page's payload; its
    trailer comes on top); anything smaller is not a page. Each baseline keeps one
    connection open, as the backend's pool does.
    """
    lengths = {k: server.command("STRLEN", k) for k in server.command("KEYS", "*")}
    pages = {k: n for k, n in lengths.items() if n >= page_bytes}
    if len(pages) != blocks:
        raise SystemExit(f"expected {blocks} pages on the server, found {len(pages)}")
    keys, sizes = list(pages), list(pages.values())
    request = b"".join(
        [b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1)]
        + [b"$%d\r\n%s\r\n" % (len(k), k) for k in keys]
    )
    reply = len(b"*%d\r\n" % len(keys)) + sum(len(b"$%d\r\n\r\n" % n) + n for n in sizes)
    view = memoryview(bytearray(reply))
    if server.password is not None:
        raise SystemExit("the wire baseline speaks to a server without a password")
    sock = stack.enter_context(socket.create_connection((server.host, server.port)))

    def wire() -> None:
        sock.sendall(request)
        got = 0
        while got < reply:
            n = sock.recv_into(view[got : got + (1 << 20)])
            if n == 0:
                raise SystemExit("the server closed the connection")
            got += n

    # The backend's connection settings that matter here: RESP2 and 1 MiB reads.
    client = redis.Redis(host=server.host, port=server.port, protocol=2, socket_read_size=1 << 20)
    stack.callback(client.close)
    return {"wire": wire, "redis-py": lambda: client.mget(keys)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=63, help="blocks per load (63)")
    parser.add_argument("--trials", type=int, default=31, help="interleaved trials (31)")
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=KV_HEADS,
        help="KV heads a rank holds (2: TP=1; 1: a rank of TP=2, 16 KiB pieces)",
    )
    parser.add_argument(
        "--backend",
        choices=("lmdb", "redis", "mooncake"),
        default="lmdb",
        help="the store to load from (lmdb; redis, mooncake: servers this benchmark starts)",
    )
    parser.add_argument("--contend", action="store_true", help="also with a busy Python thread")
    parser.add_argument(
        "--hog", action="store_true", help="also with a thread that never lets the GIL go itself"
    )
    args = parser.parse_args()
    piece = 2 * args.kv_heads * TOKENS * HEAD_DIM * 4
    nbytes = args.blocks * LAYERS * piece
    with contextlib.ExitStack() as stack:
        path = stack.enter_context(tempfile.TemporaryDirectory())
        backend = None
        if args.backend == "redis":
            server = stack.enter_context(RedisServer())
            backend = ("redis", dict(server.options))
        elif args.backend == "mooncake":
            keep_transfers_on_loopback()
            # room for the saved pages with plenty to spare (Mooncake evicts when full)
            segment = max(256 << 20, 4 * nbytes)
            cluster = stack.enter_context(
                MooncakeCluster(storage_processes=1, segment_size=segment)
            )
            backend = ("mooncake", {**cluster.options, "read_env": False})
        conn, hashes, slots = build(path, args.blocks, args.kv_heads, backend)
        src = ctypes.create_string_buffer(os.urandom(nbytes), nbytes)
        dst = ctypes.create_string_buffer(nbytes)

        def load() -> None:
            result = conn.load(hashes, slots)
            if result.loaded != args.blocks:
                raise SystemExit(f"the load did not load every block: {result}")

        variants: dict[str, Callable[[], object]] = {
            "memcpy": lambda: ctypes.memmove(dst, src, nbytes),
            "load": load,
        }
        if args.backend == "redis":
            variants.update(redis_baselines(server, args.blocks, LAYERS * piece, stack))
        elif args.backend == "mooncake":
            variants.update(mooncake_baseline(conn, hashes))
        print(
            f"torch {torch.__version__}, {os.cpu_count()} CPUs; {args.backend}; "
            f"{args.blocks} blocks of {LAYERS} layers x {piece >> 10} KiB "
            f"({nbytes / 2**20:.0f} MiB), {args.trials} trials, medians"
        )
        runs: list[tuple[str, Callable[[threading.Event], None] | None]] = [("quiet", None)]
        if args.contend:
            runs.append(("busy Python thread", _spin))
        if args.hog:
            runs.append(("GIL-holding thread", _hog))
        for label, other in runs:
            stop = threading.Event()
            if other is not None:
                threading.Thread(target=other, args=(stop,), daemon=True).start()
            try:
                med = interleaved_medians(variants, args.trials)
            finally:
                stop.set()
            line = f"{label:20s} " + "  ".join(f"{k} {v * 1e3:6.2f} ms" for k, v in med.items())
            line += f"  load/memcpy {med['load'] / med['memcpy']:.2f}"
            for floor in ("wire", "get"):
                if floor in med:
                    line += f"  load/{floor} {med['load'] / med[floor]:.2f}"
            print(line)
        conn.close()


def _spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        if n % 1000 == 0:
            time.sleep(0)


def _hog(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


if __name__ == "__main__":
    main()
