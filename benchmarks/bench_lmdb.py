"""LMDB: what the backend's options and read paths cost, side by side in one run.

Three sections, each timing its variants interleaved (every trial runs each variant
once, in a new shuffled order, so a busy neighbour slows all of them alike); medians.
A batch is one 2,048-token request of Qwen2.5-0.5B at 32 tokens per block: 63 pages
of 768 KiB (24 layers x 2 KV heads x 64 dims x K,V x fp32 x 32 tokens), 47 MiB.

``put``
    Raw py-lmdb puts of a fresh batch into a growing store: py-lmdb's defaults,
    kvconn's options (no sync), ``sync=true``, data synced but not the meta page,
    ``writemap``, ``writemap`` + ``map_async``, ``putmulti`` and ``append`` (sorted
    keys); kvconn's ``put``; and the same pages written as safetensors files, one per
    page (vLLM's ExampleConnector writes one file per layer and request).
``read``
    From a warm page cache: raw gets, kvconn's ``exists`` and ``get`` as they were
    before issue 17 and now, and a load of the batch as sealed pages (page + xxh3
    trailer) into a pool: (a) ``get`` into staging, verify the staging copy, scatter;
    (b) ``borrow``, then page by page verify it in the map and copy it into the pool;
    (b') the same, verifying every page before copying any; safetensors files loaded
    and copied. ``copies`` is a load's time over a plain ``memcpy`` of the
    same payload bytes in the same run.
``fresh``
    The first lookup (``exists`` of 63 keys) and the load after it in a new process,
    on a store of ``--store-gib`` written by this one, with ``data.mdb`` dropped from
    the page cache first (cold) or read in full first (warm). ``registry`` is
    ``load_backend``'s entry-point lookup, ``open`` the backend's constructor (the
    header check and ``lmdb.open``), ``txn`` the process's first read transaction (its
    reader slot); ``1st exists`` comes after them.

    python benchmarks/bench_lmdb.py                       # all sections, 768 KiB pages
    python benchmarks/bench_lmdb.py --section put --value-kib 64 256 768
    python benchmarks/bench_lmdb.py --section put --only writemap --trials 25
    python benchmarks/bench_lmdb.py --section fresh --store-gib 4 --fresh-trials 7

safetensors is optional (``pip install safetensors``); without it its rows are skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
from kvconn_lmdb import LmdbBackend

from kvconn.integrity import XXH3_64, PageChecksum
from kvconn.registry import backend_class

KiB, MiB = 1 << 10, 1 << 20
PAGE = 768 * KiB
BATCH = 63  # pages of one 2,048-token request
TRAILER = PageChecksum(XXH3_64).size
#: Options of the raw py-lmdb variants; kvconn's are the backend's own (unchanged).
KVCONN_FLAGS: dict[str, Any] = dict(sync=False, metasync=False, readahead=False, meminit=False)
REFERENCE = "kvconn options (no sync)"
RAW_PUTS: dict[str, dict[str, Any]] = {
    "py-lmdb defaults (sync)": {},
    REFERENCE: KVCONN_FLAGS,
    "kvconn sync=true": {**KVCONN_FLAGS, "sync": True, "metasync": True},
    "data sync, no meta sync": {**KVCONN_FLAGS, "sync": True},
    "writemap, no sync": {**KVCONN_FLAGS, "writemap": True},
    "writemap + map_async": {
        **KVCONN_FLAGS,
        "sync": True,
        "metasync": True,
        "writemap": True,
        "map_async": True,
    },
    "putmulti, no sync": KVCONN_FLAGS,
    "append, no sync": KVCONN_FLAGS,
}


def request_keys(request: int, count: int = BATCH) -> list[str]:
    """Connector-shaped keys of one request's pages (a hash chain stands in)."""
    return [
        "kvconn/Qwen%2FQwen2.5-0.5B-Instruct/w1r0/lg0/t32b786432-xxh3-64-5f1e2d3c4b5a/"
        + hashlib.blake2b(f"{request}/{i}".encode(), digest_size=16).hexdigest()
        for i in range(count)
    ]


class PreviousLmdbBackend(LmdbBackend):
    """The backend's reads as they were before issue 17, for comparison.

    ``exists`` fetched each value, which py-lmdb pre-faults page by page; reads took a
    plain transaction (no remap gate, no readahead advice).
    """

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        with self._txn_env().begin(buffers=True) as txn:
            return [txn.get(k.encode()) is not None for k in keys]

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        out = []
        with self._txn_env().begin(buffers=True) as txn:
            for key, buf in zip(keys, buffers):
                value = txn.get(key.encode())
                if value is None or len(value) != buf.nbytes:
                    out.append(False)
                    continue
                buf[:] = value
                out.append(True)
        return out


BACKENDS: dict[str, tuple[type[LmdbBackend], dict[str, Any]]] = {
    "previous": (PreviousLmdbBackend, {}),
    "now": (LmdbBackend, {}),
    "now, readahead on for lookups": (LmdbBackend, {}),
    "now, no readahead for copies": (LmdbBackend, {}),
    "now, max_readers 65536": (LmdbBackend, {"max_readers": 65536}),
}


def timed(variants: dict[str, Callable[[], object]], trials: int) -> dict[str, list[float]]:
    """Seconds per variant per trial; each trial runs every variant once, shuffled.

    The first trial is a warm-up (page faults, allocations) and is not kept.
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for trial in range(trials + 1):
        random.shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            if trial:
                samples[name].append(time.perf_counter() - start)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-trial ratios a/b."""
    ratios = sorted(x / y for x, y in zip(a, b))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), q[0], q[2]


def random_bytes(n: int, seed: int) -> bytearray:
    import numpy as np

    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def safetensors_problem() -> str | None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as exc:
        return f"safetensors is not installed ({exc}); pip install safetensors"
    return None


def read_ahead_kb(path: Path) -> str:
    """The block device's readahead, which decides what a fault with readahead reads."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue"):
        try:
            return (queue / "read_ahead_kb").read_text().strip() + " KiB"
        except OSError:
            continue
    return "unknown"


def header(root: Path, what: str) -> None:
    print(
        f"py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), Linux "
        f"{platform.release()}, {os.cpu_count()} CPUs, read_ahead_kb {read_ahead_kb(root)}; "
        f"{what}",
        flush=True,
    )


# ------------------------------------------------------------------ put
def put_section(root: Path, value_kib: int, trials: int, only: Sequence[str] = ()) -> None:
    size = value_kib * KiB
    n = max(1, round(BATCH * PAGE / size))
    values = [memoryview(random_bytes(size, i)) for i in range(n)]
    header(
        root,
        f"put of {n} values of {value_kib} KiB ({n * size / MiB:.0f} MiB) into a "
        f"growing store, {trials} interleaved trials, medians",
    )
    chosen = {
        name: flags
        for name, flags in RAW_PUTS.items()
        if name == REFERENCE or not only or any(word in name for word in only)
    }
    envs = {
        name: lmdb.open(str(root / f"raw{i}"), map_size=1 << 36, max_dbs=0, **flags)
        for i, (name, flags) in enumerate(chosen.items())
    }
    backend = LmdbBackend(root / "kvconn", map_size=1 << 36)
    counter = [0]

    def fresh_keys(sorted_after: bool = False) -> list[bytes]:
        counter[0] += 1
        if sorted_after:  # append needs keys above every stored key
            return [b"~append/%012d/%04d" % (counter[0], i) for i in range(n)]
        return [k.encode() for k in request_keys(1_000_000 + counter[0], n)]

    def raw(name: str) -> Callable[[], None]:
        env = envs[name]
        multi, append = name.startswith("putmulti"), name.startswith("append")

        def run() -> None:
            keys = fresh_keys(sorted_after=append)
            with env.begin(write=True) as txn:
                if multi:
                    txn.cursor().putmulti(list(zip(keys, values)), overwrite=False)
                else:
                    for key, value in zip(keys, values):
                        txn.put(key, value, overwrite=False, append=append)

        return run

    def kvconn_put() -> None:
        keys = [k.decode() for k in fresh_keys()]
        assert backend.put(keys, values) == [True] * n

    variants: dict[str, Callable[[], object]] = {name: raw(name) for name in chosen}
    if not only or any(word in "kvconn LmdbBackend.put" for word in only):
        variants["kvconn LmdbBackend.put"] = kvconn_put
    problem = safetensors_problem()
    if only and not any(word in "safetensors" for word in only):
        problem = "not chosen (--only)"
    if problem is None:
        import torch
        from safetensors.torch import save_file

        tensors = [torch.frombuffer(v, dtype=torch.uint8) for v in values]
        (root / "st").mkdir()

        def safetensors_save() -> None:
            counter[0] += 1
            folder = root / "st" / str(counter[0])
            folder.mkdir()
            for i, tensor in enumerate(tensors):
                save_file({"kv": tensor}, str(folder / f"{i}.safetensors"))

        variants["safetensors, a file per value"] = safetensors_save
    samples = timed(variants, trials)
    ref = samples[REFERENCE]
    print(f"{'variant':34} {'ms':>8} {'GiB/s':>7}   vs kvconn options [p25-p75]")
    for name, xs in samples.items():
        m, lo, hi = paired(ref, xs)
        print(
            f"{name:34} {median(xs) * 1e3:8.1f} {n * size / median(xs) / 2**30:7.2f}   "
            f"{m:5.2f}x [{lo:.2f}-{hi:.2f}]"
        )
    if problem:
        print(f"safetensors skipped: {problem}")
    backend.close()
    for env in envs.values():
        env.close()


# ------------------------------------------------------------------ read
def read_section(root: Path, trials: int) -> None:
    import numpy as np

    n, row = BATCH, PAGE + TRAILER
    checksum = PageChecksum(XXH3_64)
    keys = request_keys(0)
    staging = np.empty(n * row, dtype=np.uint8)
    views = [staging.data[i * row : (i + 1) * row] for i in range(n)]
    staging[:] = np.frombuffer(random_bytes(n * row, 1), dtype=np.uint8)
    checksum.seal(views, keys)
    sealed = [bytes(v) for v in views]
    header(
        root,
        f"warm reads of {n} pages of {PAGE // KiB} KiB (+{TRAILER} B checksum), "
        f"{trials} interleaved trials, medians",
    )

    path = root / "store"
    now = LmdbBackend(path)
    previous = PreviousLmdbBackend(path)  # the same environment (shared per process)
    now.put(keys, sealed)
    raw_envs = {}
    for name, flags in (("defaults", {}), ("kvconn", KVCONN_FLAGS)):
        env = lmdb.open(str(root / f"raw-{name}"), map_size=1 << 32, max_dbs=0, **flags)
        with env.begin(write=True) as txn:
            for key, value in zip(keys, sealed):
                txn.put(key.encode(), value)
        raw_envs[name] = env
    encoded = [k.encode() for k in keys]

    pool = np.zeros((2 * n, PAGE), dtype=np.uint8)  # destination slots, in random order
    slots = np.array(random.sample(range(2 * n), n))
    source = np.frombuffer(random_bytes(n * PAGE, 2), dtype=np.uint8).reshape(n, PAGE)
    copy_dst = np.empty_like(source)

    def raw_get(name: str, buffers: bool) -> Callable[[], None]:
        env = raw_envs[name]

        def run() -> None:
            with env.begin(buffers=True) if buffers else env.begin() as txn:
                for key, view in zip(encoded, views):
                    value = txn.get(key)
                    assert value is not None
                    view[:] = value

        return run

    def load_today() -> None:  # what the connector does now: get, verify, scatter
        assert now.get(keys, views, scratch=True) == [True] * n
        assert all(checksum.verify(views, keys))
        pool[slots] = staging.reshape(n, row)[:, :PAGE]

    def load_borrowed() -> None:  # page by page: verify in the map, then one copy
        with now.borrow(keys) as lent:
            for key, view, slot in zip(keys, lent, slots):
                assert view is not None and checksum.verify([view], [key]) == [True]
                pool[slot] = np.frombuffer(view, dtype=np.uint8, count=PAGE)

    def load_borrowed_batch() -> None:  # verify every page, then copy every page
        with now.borrow(keys) as lent:
            pages = [v for v in lent if v is not None]
            assert all(checksum.verify(pages, keys))
            for view, slot in zip(pages, slots):
                pool[slot] = np.frombuffer(view, dtype=np.uint8, count=PAGE)

    calls = 20  # exists is ~50 us: time 20 back to back

    def exists(backend: LmdbBackend) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                assert backend.exists(keys) == [True] * n

        return run

    variants: dict[str, Callable[[], object]] = {
        "memcpy of the payload": lambda: np.copyto(copy_dst, source),
        "raw get, py-lmdb defaults (bytes)": raw_get("defaults", False),
        "raw get, kvconn options, buffers": raw_get("kvconn", True),
        "kvconn get, previous": lambda: previous.get(keys, views, scratch=True),
        "kvconn get, now": lambda: now.get(keys, views, scratch=True),
        "load (a) get + verify + scatter": load_today,
        "load (b) borrow, verify + copy per page": load_borrowed,
        "load (b') borrow, verify all, copy all": load_borrowed_batch,
        "exists x20, previous": exists(previous),
        "exists x20, now": exists(now),
    }
    problem = safetensors_problem()
    files = [root / "st" / f"{i}.safetensors" for i in range(n)]
    if problem is None:
        import torch
        from safetensors.torch import load_file, save_file

        files[0].parent.mkdir()
        for file, page in zip(files, source):
            save_file({"kv": torch.from_numpy(page.copy())}, str(file))

        def st_load() -> None:
            for file, slot in zip(files, slots):
                pool[slot] = load_file(str(file))["kv"].numpy()

        def st_lookup() -> None:
            for _ in range(calls):
                assert all(os.path.exists(f) for f in files)

        variants["safetensors load + copy"] = st_load
        variants["safetensors lookup x20 (63 stats)"] = st_lookup
    samples = timed(variants, trials)
    memcpy = samples["memcpy of the payload"]
    payload = n * PAGE
    print(f"{'variant':42} {'ms':>8} {'GB/s':>6} {'copies':>7} [p25-p75]")
    for name, xs in samples.items():
        per_call = median(xs) / (calls if "x20" in name else 1)
        if "x20" in name:
            print(f"{name:42} {per_call * 1e3:8.3f}  (one call of {n} keys)")
            continue
        m, lo, hi = paired(xs, memcpy)
        print(
            f"{name:42} {per_call * 1e3:8.2f} {payload / per_call / 1e9:6.2f} "
            f"{m:7.2f} [{lo:.2f}-{hi:.2f}]"
        )
    old, new = samples["exists x20, previous"], samples["exists x20, now"]
    m, lo, hi = paired(old, new)
    print(
        f"exists, previous/now: {median(old) / median(new):.1f}x (ratio of medians), "
        f"per-trial {m:.1f}x [{lo:.1f}-{hi:.1f}]"
    )
    if problem:
        print(f"safetensors skipped: {problem}")
    previous.close()
    now.close()
    for env in raw_envs.values():
        env.close()


# ------------------------------------------------------------------ fresh process
def resident_fraction(path: Path) -> float:
    """Share of ``path``'s pages in the page cache (mincore over a fresh map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)  # fmt: skip
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * pages)()
        libc.mincore(addr, size, vec)
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in bytes(vec)) / pages


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def child(path: str, variant: str, first: int, second: int) -> None:
    """One new process: open, first lookup, load of those pages, a second lookup."""

    def faults() -> tuple[int, int]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_majflt, usage.ru_minflt

    cls, options = BACKENDS[variant]
    out: dict[str, Any] = {}
    start = time.perf_counter()
    assert backend_class("lmdb") is LmdbBackend  # what load_backend does first
    out["registry"] = time.perf_counter() - start
    start = time.perf_counter()
    backend = cls(path, **options)
    out["open"] = time.perf_counter() - start
    start = time.perf_counter()
    with backend._read_txn(read_ahead=False):  # this process's first reader slot
        pass
    out["txn"] = time.perf_counter() - start
    if "readahead on" in variant:
        backend._shared._advise("MADV_NORMAL")
    if "no readahead" in variant:  # the map stays MADV_RANDOM while values are copied
        backend._shared._advise = lambda advice: None  # type: ignore[method-assign]
    keys = request_keys(first)
    f0, start = faults(), time.perf_counter()
    assert backend.exists(keys) == [True] * BATCH
    out["exists"] = time.perf_counter() - start
    f1 = faults()
    out["exists_faults"] = [f1[0] - f0[0], f1[1] - f0[1]]
    row = PAGE + TRAILER
    staging = bytearray(BATCH * row)
    buffers = [memoryview(staging)[i * row : (i + 1) * row] for i in range(BATCH)]
    start = time.perf_counter()
    assert backend.get(keys, buffers, scratch=True) == [True] * BATCH
    out["load"] = time.perf_counter() - start
    f2 = faults()
    out["load_faults"] = [f2[0] - f1[0], f2[1] - f1[1]]
    start = time.perf_counter()
    assert backend.exists(request_keys(second)) == [True] * BATCH
    out["exists2"] = time.perf_counter() - start
    backend.close()
    print(json.dumps(out))


def fresh_section(root: Path, store_gib: float, trials: int) -> None:
    path = root / "shared-store"
    requests = max(2, int(store_gib * 2**30 // (BATCH * (PAGE + TRAILER))))
    value = bytes(random_bytes(PAGE + TRAILER, 3))
    writer = LmdbBackend(path, map_size=1 << 36)
    for r in range(requests):
        writer.put(request_keys(r), [value] * BATCH)
    writer.close()
    data = path / "data.mdb"
    header(
        root,
        f"first lookup in a new process: store of {data.stat().st_size / 2**30:.1f} GiB "
        f"({requests} requests of {BATCH} pages), {trials} interleaved trials, medians",
    )
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {
        (v, cold): [] for v in BACKENDS for cold in (True, False)
    }
    resident: list[float] = []
    warmed: list[float] = []

    def spawn(variant: str, cold: bool) -> None:
        first, second = random.sample(range(requests), 2)
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(path), variant, str(first), str(second)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs[(variant, cold)].append(json.loads(done.stdout))

    for trial in range(trials):
        # Cold and warm cases in two groups (a cold case would cool the next warm one),
        # each shuffled; which group goes first alternates.
        for cold in (True, False) if trial % 2 else (False, True):
            if not cold:
                with open(data, "rb") as fh:  # the whole store into the page cache
                    while fh.read(64 * MiB):
                        pass
                warmed.append(resident_fraction(data))
            for variant in random.sample(list(BACKENDS), len(BACKENDS)):
                if cold:
                    drop_from_page_cache(data)
                    resident.append(resident_fraction(data))
                spawn(variant, cold)
    print(
        f"cold: data.mdb dropped from the page cache before each process (resident after: "
        f"median {median(resident):.1%}); warm: read in full first ({median(warmed):.1%})"
    )
    print(
        f"{'variant':30} {'cache':5} {'registry':>8} {'open':>6} {'txn':>6} {'1st exists':>10} "
        f"{'faults maj/min':>14} {'load':>7} {'faults maj/min':>14} {'2nd exists':>10}  (ms)"
    )
    for variant in BACKENDS:
        for cold in (True, False):
            rows = runs[(variant, cold)]

            def med(field: str, rows: list[dict[str, Any]] = rows) -> float:
                return median([r[field] for r in rows]) * 1e3

            def flt(field: str, rows: list[dict[str, Any]] = rows) -> str:
                return "/".join(str(int(median([r[field][i] for r in rows]))) for i in (0, 1))

            print(
                f"{variant:30} {'cold' if cold else 'warm':5} {med('registry'):8.2f} "
                f"{med('open'):6.2f} {med('txn'):6.2f} {med('exists'):10.2f} "
                f"{flt('exists_faults'):>14} {med('load'):7.1f} {flt('load_faults'):>14} "
                f"{med('exists2'):10.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--section", nargs="+", choices=("put", "read", "fresh"),
                        default=["put", "read", "fresh"])  # fmt: skip
    parser.add_argument("--value-kib", type=int, nargs="+", default=[768],
                        help="value sizes of the put section (768)")  # fmt: skip
    parser.add_argument("--trials", type=int, default=9, help="put trials (9)")
    parser.add_argument("--only", nargs="+", default=[], metavar="WORD",
                        help="put: only variants whose names contain a WORD "
                        "(and kvconn's options, the reference)")  # fmt: skip
    parser.add_argument("--read-trials", type=int, default=21, help="read trials (21)")
    parser.add_argument("--fresh-trials", type=int, default=5, help="processes per case (5)")
    parser.add_argument("--store-gib", type=float, default=2.0, help="fresh store size (2)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the stores go (default: a temporary directory)")  # fmt: skip
    parser.add_argument("--child", nargs=4, metavar=("PATH", "VARIANT", "FIRST", "SECOND"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.child:
        path, variant, first, second = args.child
        child(path, variant, int(first), int(second))
        return 0
    base = tempfile.mkdtemp(prefix="kvconn-bench-lmdb-", dir=args.dir)
    try:
        if "put" in args.section:
            for kib in args.value_kib:
                put_dir = Path(base) / f"put{kib}"
                put_dir.mkdir()
                put_section(put_dir, kib, args.trials, args.only)
                shutil.rmtree(put_dir)
                print()
        if "read" in args.section:
            read_dir = Path(base) / "read"
            read_dir.mkdir()
            read_section(read_dir, args.read_trials)
            shutil.rmtree(read_dir)
            print()
        if "fresh" in args.section:
            fresh_section(Path(base), args.store_gib, args.fresh_trials)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
