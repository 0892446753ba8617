"""Cost of page checksums against the transfer they protect, per backend and page size.

Two connectors share one backend and one KV pool: one stores each page with its xxh3-64
trailer (the default), the other bare pages (``checksum = "none"``, other keys). Every
trial times, in a shuffled order: a save of a fresh batch with each (exists, gather,
seal, put; the keys are deleted again untimed), a load of a stored batch with each (get,
verify, scatter), and, on the same pages with no store, the checksum alone (seal,
verify) and a plain copy of the same bytes. Reported: medians over trials and the ratio
checksum / none of the same run; seal and verify alone as a share of the bare save and
load; xxh3 speed against the copy.

The pool is a sharded K/V page of ``--page-kib`` (16 KiB per layer, layer after layer
in one slot), rank 0 of TP=8. Servers are started on free loopback ports: Redis (a
``redis-server``) and Mooncake (a master and one storage process).

    python benchmarks/bench_integrity.py                       # lmdb, redis, mooncake
    python benchmarks/bench_integrity.py --backend lmdb --page-kib 64 --trials 31
    python benchmarks/bench_integrity.py --gather              # staging-row gather options
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import xxhash

from kvconn.backend import Backend, tensor_bytes
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.integrity import NONE, XXH3_64, PageChecksum
from kvconn.movement import PageMover
from kvconn.plan import plan_pages, share_key
from kvconn.registry import load_backend
from kvconn.tools.devserver.mooncake import MooncakeCluster, keep_transfers_on_loopback
from kvconn.tools.devserver.redis import RedisServer
from kvconn.tools.models import RoleSpec, interleaved_layout

MiB = 2**20
BACKENDS = ("lmdb", "redis", "mooncake")
ROLES = (RoleSpec("k", 256, 8, "bf16"), RoleSpec("v", 256, 8, "bf16"))  # 16 KiB per layer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument(
        "--page-kib", type=int, nargs="+", default=[16, 64, 256], help="multiples of 16"
    )
    parser.add_argument("--batch-mib", type=int, default=16, help="bytes per save/load (16)")
    parser.add_argument("--trials", type=int, default=21, help="interleaved trials (21)")
    parser.add_argument(
        "--gather", action="store_true", help="only compare ways of gathering into staging rows"
    )
    args = parser.parse_args(argv)
    if any(k < 16 or k % 16 for k in args.page_kib):
        parser.error("--page-kib values must be multiples of 16")
    return args


def medians(
    variants: dict[str, Callable[[], object]],
    trials: int,
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per variant; every trial runs each once, in a new shuffled order.

    ``before`` / ``after`` run untimed around each trial (fresh keys, clean-up).
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for trial in range(trials + 1):  # the first is a warm-up: page faults, allocations
        if before is not None:
            before()
        random.shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            if trial:
                samples[name].append(time.perf_counter() - start)
        if after is not None:
            after()
    return {name: statistics.median(times) for name, times in samples.items()}


@contextlib.contextmanager
def open_backend(name: str, span: int) -> Iterator[Backend]:
    """The named backend on a throwaway store with room for a few batches of ``span``."""
    if name == "lmdb":
        with tempfile.TemporaryDirectory(prefix="kvconn-bench-") as path:
            backend = load_backend("lmdb", {"path": path})
            try:
                yield backend
            finally:
                backend.close()
    elif name == "redis":
        with RedisServer() as server:
            backend = load_backend("redis", server.options)
            try:
                yield backend
            finally:
                backend.close()
    else:
        keep_transfers_on_loopback()
        with MooncakeCluster(storage_processes=1, segment_size=max(64 * MiB, 8 * span)) as mc:
            backend = load_backend("mooncake", {**mc.options, "read_env": False})
            try:
                yield backend
            finally:
                backend.close()


def available(name: str) -> str | None:
    if name == "redis":
        return RedisServer.available()
    if name == "mooncake":
        return MooncakeCluster.available()
    return None


def measure(backend: Backend, page_kib: int, batch_mib: int, trials: int) -> dict[str, float]:
    n = max(1, batch_mib * MiB // (page_kib * 1024))
    layout = interleaved_layout(ROLES, tp_size=8, layers=page_kib // 16, num_slots=2 * n)
    pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
    conns = {
        scheme: Connector(
            ConnectorConfig(model="bench", backend=backend.name, checksum=scheme),
            layout,
            rank=0,
            pools=[pool],
            backend=backend,
        )
        for scheme in (XXH3_64, NONE)
    }
    save_slots, load_slots = list(range(n)), list(range(n, 2 * n))
    stored = [os.urandom(16) for _ in range(n)]
    for conn in conns.values():
        assert conn.save(stored, save_slots).written == n
    fresh: dict[str, list[bytes]] = {}

    def new_blocks() -> None:
        fresh.update({scheme: [os.urandom(16) for _ in range(n)] for scheme in conns})

    def delete_them() -> None:
        for scheme, conn in conns.items():
            backend.delete([share_key(conn.prefix, conn.shares[0], h) for h in fresh[scheme]])

    def save(scheme: str) -> Callable[[], None]:
        def run() -> None:
            assert conns[scheme].save(fresh[scheme], save_slots).written == n

        return run

    def load(scheme: str) -> Callable[[], None]:
        def run() -> None:
            assert conns[scheme].load(stored, load_slots).loaded == n

        return run

    # the checksum alone, on the same values the connector would seal and verify
    plan = conns[XXH3_64].plans[0]
    values_tensor = torch.randint(0, 256, (n * plan.value_size,), dtype=torch.uint8)
    copy_dst = torch.empty(n * plan.page_size, dtype=torch.uint8)
    view = tensor_bytes(values_tensor)
    row = plan.value_size
    values = [view[i * row : (i + 1) * row] for i in range(n)]
    keys = [share_key(conns[XXH3_64].prefix, conns[XXH3_64].shares[0], h) for h in stored]
    checksum = PageChecksum(XXH3_64)
    checksum.seal(values, keys)
    med = medians(
        {
            "save xxh3": save(XXH3_64),
            "save none": save(NONE),
            "load xxh3": load(XXH3_64),
            "load none": load(NONE),
            "seal": lambda: checksum.seal(values, keys),
            "verify": lambda: checksum.verify(values, keys),
            "copy": lambda: copy_dst.copy_(values_tensor[: n * plan.page_size]),
            "xxh3": lambda: xxhash.xxh3_64_intdigest(view[: n * plan.page_size]),
        },
        trials,
        before=new_blocks,
        after=delete_them,
    )
    for conn in conns.values():
        conn._staging.release()  # the backend stays open for the caller
    med["bytes"] = n * plan.page_size
    return med


def report(args: argparse.Namespace) -> None:
    print(
        f"torch {torch.__version__} (threads {torch.get_num_threads()}), xxhash "
        f"{xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION}), {os.cpu_count()} CPUs; "
        f"{args.batch_mib} MiB per save/load, {args.trials} interleaved trials, medians"
    )
    print(
        f"{'backend':>8} {'page':>8} {'save GB/s':>10} {'+xxh3':>7} {'load GB/s':>10} "
        f"{'+xxh3':>7} {'seal/save':>10} {'verify/load':>12} {'xxh3/copy':>10}"
    )
    for name in args.backend:
        problem = available(name)
        if problem:
            print(f"{name:>8}  skipped: {problem}")
            continue
        for kib in args.page_kib:
            with open_backend(name, args.batch_mib * MiB) as backend:
                m = measure(backend, kib, args.batch_mib, args.trials)
            gbs = m["bytes"] / 1e9
            print(
                f"{name:>8} {kib:>5} KiB {gbs / m['save none']:>10.2f} "
                f"{m['save xxh3'] / m['save none'] - 1:>+7.1%} {gbs / m['load none']:>10.2f} "
                f"{m['load xxh3'] / m['load none'] - 1:>+7.1%} "
                f"{m['seal'] / m['save none']:>10.1%} {m['verify'] / m['load none']:>12.1%} "
                f"{m['copy'] / m['xxh3']:>10.2f}",
                flush=True,
            )


def gather_options(args: argparse.Namespace) -> None:
    """Ways of gathering pages into staging rows of ``page_size + 8`` bytes."""
    print(
        f"gather of {args.batch_mib} MiB into rows with an 8-byte trailer, relative to a "
        f"contiguous copy of the same bytes; {args.trials} interleaved trials, medians"
    )
    print(f"{'page':>8} {'contiguous':>11} {'rows':>6} {'contig+copy':>12} {'per-run temp':>13}")
    for kib in args.page_kib:
        med = gather_medians(kib, args.batch_mib, args.trials)
        c = med["copy"]
        print(
            f"{kib:>5} KiB {c / med['contiguous']:>11.2f} {c / med['rows']:>6.2f} "
            f"{c / med['contig+copy']:>12.2f} {c / med['per-run']:>13.2f}",
            flush=True,
        )


def gather_medians(page_kib: int, batch_mib: int, trials: int) -> dict[str, float]:
    """``contiguous``: into ``[n, page]`` (no trailer); ``rows``: straight into the rows'
    payload (what kvconn does); ``contig+copy``: contiguous, then copied into the rows;
    ``per-run``: each run into a temporary, then copied (gather's fallback)."""
    n = max(1, batch_mib * MiB // (page_kib * 1024))
    layout = interleaved_layout(ROLES, tp_size=8, layers=page_kib // 16, num_slots=2 * n)
    plan = plan_pages(layout)[0]
    size = plan.page_size
    pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
    mover = PageMover(plan.regions, [pool], 2 * n)
    slots = torch.randperm(2 * n)[:n]
    flat = torch.empty(n, size, dtype=torch.uint8)
    rows = torch.empty(n, size + 8, dtype=torch.uint8)
    src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    dst = torch.empty_like(src)

    def contiguous_then_copy() -> None:
        mover.gather(slots, flat)
        rows[:, :size].copy_(flat)

    def per_run_temporary() -> None:
        for run, view in zip(mover.runs, mover._views):
            part = rows[:, run.page_offset : run.page_offset + run.nbytes]
            picked = torch.index_select(view, 0, slots)
            part.view(n, run.count, run.size).copy_(picked.view(torch.uint8))

    return medians(
        {
            "copy": lambda: dst.copy_(src),
            "contiguous": lambda: mover.gather(slots, flat),
            "rows": lambda: mover.gather(slots, rows[:, :size]),
            "contig+copy": contiguous_then_copy,
            "per-run": per_run_temporary,
        },
        trials,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.gather:
        gather_options(args)
    else:
        report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
