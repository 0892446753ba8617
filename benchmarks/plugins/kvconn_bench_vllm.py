"""Instruments for ``benchmarks/bench_engine_vllm.py``, loaded inside vLLM's processes.

vLLM imports this module through ``kv_connector_module_path="kvconn_bench_vllm"``
(``benchmarks/plugins`` is on the engine's ``PYTHONPATH``) in every process that builds
a connector: the scheduler's and each worker's. What it provides:

* ``TimedKvconnConnector``, ``TimedExampleConnector``, ``TimedMooncakeStoreConnector``:
  subclasses of kvconn's adapter and of vLLM's own connectors that time the calls vLLM
  makes on them, the same wrapper for every connector, so their figures compare. The
  subclasses are made on first use: nothing here depends on an adapter's internals, so
  the benchmark runs against whatever ``kvconn_vllm.KvconnConnector`` is at the time.
* a timer on kvconn's background transfers (``kvconn.transfer.Transfer``): submit to
  finish of each load and save, for an adapter that hands transfers to the
  ``TransferService``; a synchronous adapter leaves it silent.
* ``SlowLmdbBackend`` (``lmdb-slow``): LMDB that sleeps ``delay_s`` in every call
  that reaches the store (exists, put, get/read, borrow, delete), a stalled store
  for the stall figure. It is a kvconn
  backend found by its entry point (``kvconn_bench_vllm-0.0.dist-info`` next to this file),
  as any third-party backend would be.

Each timed call appends one JSON line to ``$BENCH_KVCONN_TIMINGS/<pid>.jsonl``:
``{"m": method, "t0": start, "dt": seconds, "pid", "role"}`` with ``t0`` on
``time.monotonic()``, one clock for every process of the machine, so the benchmark can
attribute calls to the phases it timed in its own process; ``get_transfer_results`` adds
``recving``, how many requests it reported loaded; each kvconn transfer thread
records its Linux thread id as it starts (``thread``); each pass of the garbage collector
is one ``gc`` record (generation, thread). Nothing is written when the
variable is unset, and the connector behaves exactly as its base class.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import glob
import importlib
import json
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvconn_lmdb import LmdbBackend

from kvconn.backend import ReadStatus

#: The connector calls that are timed, where the class has them. Scheduler side:
#: lookups and bookkeeping; worker side: loads, saves and completions.
TIMED_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
)

#: Connector classes the benchmark can select, by the name it selects them with.
_BASES = {
    "TimedKvconnConnector": ("kvconn_vllm", "KvconnConnector"),
    "TimedExampleConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
        "ExampleConnector",
    ),
    "TimedMooncakeStoreConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector",
        "MooncakeStoreConnector",
    ),
}

__all__ = ["TIMED_METHODS", "SlowLmdbBackend", "record", "timed_class", *_BASES]

# reentrant: a garbage collection can start inside record() (its JSON allocates), and
# the collector's callback records it on the same thread
_lock = threading.RLock()
_fd: int | None = None
_fd_pid = 0


def _sink() -> int | None:
    """This process's timing file (reopened after a fork), or None when not measuring."""
    global _fd, _fd_pid
    directory = os.environ.get("BENCH_KVCONN_TIMINGS")
    if not directory:
        return None
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:
        path = os.path.join(directory, f"{pid}.jsonl")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _fd_pid = pid
    return _fd


def record(method: str, t0: float, dt: float, **extra: Any) -> None:
    """Append one timing record; O_APPEND writes of one line do not interleave."""
    with _lock:
        fd = _sink()
        if fd is None:
            return
        line = {"m": method, "t0": t0, "dt": dt, "pid": os.getpid(), **extra}
        os.write(fd, (json.dumps(line) + "\n").encode())


def _role(connector: Any) -> str:
    role = getattr(connector, "_role", None)
    return str(getattr(role, "name", role)).lower()


def _reported_loads(results: Any) -> dict[str, int]:
    """How many requests a worker's ``get_transfer_results`` reported loaded: a request
    waiting for its load runs in the step after the one whose results report it, so
    these tell how the connector admitted requests that arrived together."""
    return {"recving": len(getattr(results, "finished_recving", None) or ())}


#: What a timed call's return value adds to its record, for the calls that add any.
_NOTED: dict[str, Callable[[Any], dict[str, int]]] = {"get_transfer_results": _reported_loads}


def _timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    note = _NOTED.get(name)

    @functools.wraps(call)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        extra: dict[str, int] = {}
        try:
            result = call(self, *args, **kwargs)
            if note is not None:
                extra = note(result)
            return result
        finally:
            record(name, start, time.monotonic() - start, role=_role(self), **extra)

    return wrapper


def _register_kv_caches(base: Any) -> Callable[..., Any]:
    """Also note the rank's KV bytes per block, and time a plain memcpy in this process.

    The load figure is read against a memcpy of the bytes a hit loads
    (``BENCH_KVCONN_MEMCPY_BLOCKS`` blocks of this rank's KV cache), timed here, in the
    worker that does the load, before any request: the same process, the same memory.
    It is timed from memory, as a hit's bytes are read: pages another engine stored
    seconds before, into slots the forward pass has since pushed out of every cache. A
    copy between two buffers it just copied can be faster (1.6-1.9x at 4-24 MiB on a
    machine with a 300 MiB last-level cache; about equal on one with 32 MiB); that one is
    recorded too (``hot``).
    """
    call = base.register_kv_caches

    @functools.wraps(call)
    def register_kv_caches(self: Any, kv_caches: dict[str, Any]) -> Any:
        start = time.monotonic()
        try:
            return call(self, kv_caches)
        finally:
            record("register_kv_caches", start, time.monotonic() - start, role=_role(self))
            _note_geometry(self, kv_caches)

    return register_kv_caches


def _note_geometry(connector: Any, kv_caches: dict[str, Any]) -> None:
    blocks = int(connector._kv_cache_config.num_blocks)
    seen: set[int] = set()
    total = 0
    for tensor in kv_caches.values():
        if tensor.data_ptr() in seen:  # a layer sharing another's KV adds nothing
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    per_block = total // blocks
    record("kv_geometry", time.monotonic(), 0.0, role="worker", bytes_per_block=per_block)
    wanted = int(os.environ.get("BENCH_KVCONN_MEMCPY_BLOCKS", "0"))
    if wanted > 0:
        nbytes = wanted * per_block
        cold, hot = memcpy_seconds(nbytes)
        record("memcpy", time.monotonic(), cold, role="worker", bytes=nbytes, hot=hot)


def memcpy_seconds(nbytes: int, repeats: int = 7) -> tuple[float, float]:
    """Median times of ``memmove`` (libc's memcpy) of ``nbytes`` between two touched
    buffers: from memory (both pushed out of the CPU's caches before each copy), then
    from cache (the same buffers, copied again straight after)."""
    src = (ctypes.c_char * nbytes)()
    dst = (ctypes.c_char * nbytes)()
    ctypes.memset(src, 1, nbytes)  # touch every page of both first: no page faults timed
    ctypes.memmove(dst, src, nbytes)
    flush = (ctypes.c_char * min(2 * _largest_cache(), 1 << 30))()

    def copy() -> float:
        start = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        return time.perf_counter() - start

    cold = []
    for i in range(repeats):
        ctypes.memset(flush, i + 2, len(flush))  # twice the cache's size evicts src and dst
        cold.append(copy())
    hot = [copy() for _ in range(repeats)]
    return statistics.median(cold), statistics.median(hot)


def _largest_cache() -> int:
    """Bytes of the largest CPU cache sysfs reports (256 MiB if it reports none)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=256 << 20)


@functools.cache
def timed_class(name: str) -> type:
    """The connector class ``name`` selects, with every call in TIMED_METHODS timed."""
    module, base_name = _BASES[name]
    base = getattr(importlib.import_module(module), base_name)
    namespace: dict[str, Any] = {"__module__": __name__, "__doc__": f"{base_name}, timed."}
    for method in TIMED_METHODS:
        call = getattr(base, method, None)
        if callable(call):
            namespace[method] = _timed(method, call)
    namespace["register_kv_caches"] = _register_kv_caches(base)
    return type(name, (base,), namespace)


def __getattr__(name: str) -> Any:
    if name in _BASES:
        return timed_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unpatched(module: str, class_name: str, method: str) -> tuple[Any, Any] | None:
    """A kvconn class and its method, unless missing or already timed by this plugin."""
    try:
        cls = getattr(importlib.import_module(module), class_name, None)
    except ImportError:
        return None
    call = getattr(cls, method, None)
    if cls is None or call is None or getattr(call, "_kvconn_bench", False):
        return None
    return cls, call


def _time_background_transfers() -> None:
    """Record submit -> finish of every kvconn background transfer in this process.

    ``Transfer._finish`` runs once per transfer, on whichever thread finishes it; its
    ``submitted`` stamp is ``time.monotonic()`` of the submit.
    """
    found = _unpatched("kvconn.transfer", "Transfer", "_finish")
    if found is None:  # a core without the transfer service, or timed already
        return
    cls, finish = found

    @functools.wraps(finish)
    def _finish(self: Any, result: Any) -> Any:
        done = finish(self, result)
        if done is not False:
            submitted = float(getattr(self, "submitted", time.monotonic()))
            record(
                f"transfer_{getattr(self, 'kind', '?')}",
                submitted,
                time.monotonic() - submitted,
                role="worker",
                blocks=getattr(self, "blocks", None),
            )
        return done

    _finish._kvconn_bench = True  # type: ignore[attr-defined]
    cls._finish = _finish


def _name_transfer_threads() -> None:
    """Record each kvconn transfer thread's Linux thread id as it starts, so the
    benchmark can tell its CPU time from the rest of the engine's (``thread`` records)."""
    found = _unpatched("kvconn.transfer", "TransferService", "_run")
    if found is None:
        return
    cls, run = found

    @functools.wraps(run)
    def _run(self: Any, loop: Any) -> Any:
        thread = threading.current_thread()
        record(
            "thread", time.monotonic(), 0.0, role="worker", tid=thread.native_id, name=thread.name
        )
        return run(self, loop)

    _run._kvconn_bench = True  # type: ignore[attr-defined]
    cls._run = _run


def _time_collections() -> None:
    """Record each pass of Python's garbage collector in this process (``gc``, with its
    generation and thread): a pass runs on whichever thread allocates, the forward
    pass's among them, and over a heap as large as an engine's it can take longer than
    a connector's whole load."""
    if any(getattr(callback, "_kvconn_bench", False) for callback in gc.callbacks):
        return
    started: list[float] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.monotonic())
        elif started:
            t0 = started.pop()
            generation = info.get("generation", -1)
            tid = threading.get_native_id()
            record("gc", t0, time.monotonic() - t0, gen=generation, tid=tid)

    on_collection._kvconn_bench = True  # type: ignore[attr-defined]
    gc.callbacks.append(on_collection)


def _time_load_work() -> None:
    """Record each kvconn load's own work (read, verify, scatter: ``Connector.load_into``
    on the load thread), without the queueing and hand-off around it.

    Its wall time counts the time the thread waited for a CPU or the GIL as well; its
    CPU time (``cpu``, the thread's own) counts only the work, so the two tell the copies
    a load makes from the CPUs it shares (three processes on two CPUs at TP=2).
    ``on_step`` is 1 for a load that ran on the step's cores (those of the process's
    main thread, which runs vLLM's step), else 0: whether an idle step's load went there.
    """
    found = _unpatched("kvconn.connector", "Connector", "load_into")
    if found is None:
        return
    cls, load_into = found

    @functools.wraps(load_into)
    def _load_into(self: Any, hashes: Any, *args: Any, **kwargs: Any) -> Any:
        start, cpu = time.monotonic(), time.thread_time()
        before = resource.getrusage(resource.RUSAGE_THREAD)
        _passes.times = {name: [0.0, 0.0] for name in _PASSES}
        try:
            return load_into(self, hashes, *args, **kwargs)
        finally:
            after = resource.getrusage(resource.RUSAGE_THREAD)
            passes, _passes.times = _passes.times, None
            record(
                "load_work",
                start,
                time.monotonic() - start,
                role="worker",
                blocks=len(hashes),
                cpu=time.thread_time() - cpu,
                on_step=float(_on_step_cores()),
                minor_faults=after.ru_minflt - before.ru_minflt,
                major_faults=after.ru_majflt - before.ru_majflt,
                **{f"{name}_s": wall for name, (wall, _) in passes.items()},
                **{f"{name}_cpu": used for name, (_, used) in passes.items()},
            )

    _load_into._kvconn_bench = True  # type: ignore[attr-defined]
    cls.load_into = _load_into
    _time_load_passes()


def _on_step_cores() -> bool:
    """Whether this thread runs on the cores of the process's main thread (the step's)."""
    try:
        main = threading.main_thread().native_id
        return main is not None and os.sched_getaffinity(0) == os.sched_getaffinity(main)
    except (AttributeError, OSError):
        return False


#: The passes of a lent load (``kvconn.lent_load``) timed apart inside ``load_work``,
#: wall and CPU: with the faults, they say where a load that took longer than another
#: of the same bytes (a fresh engine's first against a repeat) lost the time.
_PASSES = ("checksum", "scatter")
_passes = threading.local()


def _time_load_passes() -> None:
    """Sum each pass's wall and CPU time into the load running on this thread."""
    try:
        lent: Any = importlib.import_module("kvconn.lent_load")
        integrity: Any = importlib.import_module("kvconn.integrity")
    except ImportError:
        return

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            times = getattr(_passes, "times", None)
            if times is None:
                return call(*args, **kwargs)
            start, cpu = time.monotonic(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                times[name][0] += time.monotonic() - start
                times[name][1] += time.thread_time() - cpu

        wrapper._kvconn_bench = True  # type: ignore[attr-defined]
        return wrapper

    if not getattr(lent.scatter_host_pages, "_kvconn_bench", False):
        lent.scatter_host_pages = timed("scatter", lent.scatter_host_pages)
    verify = integrity.PageChecksum.verify
    if not getattr(verify, "_kvconn_bench", False):
        integrity.PageChecksum.verify = timed("checksum", verify)


def _note_modules() -> None:
    """Record where this process imported kvconn and its adapter from: the benchmark
    reports it, so a run shows which checkout it measured."""
    files = {}
    for module in ("kvconn", "kvconn_vllm", "kvconn_lmdb"):
        try:
            files[module] = getattr(importlib.import_module(module), "__file__", None)
        except ImportError as exc:
            files[module] = f"not importable: {exc}"
    record("modules", time.monotonic(), 0.0, role="?", files=files)


def _connect_on_the_kept_core() -> None:
    """kvconn-mooncake-keptcore: the adapter connects from the core vLLM keeps for KV
    transfers, where kvconn's transfer threads run (``transfer_cpus = "auto"``), so the
    store client's own threads start there too, as the adapter did from 2026-12-05 to
    2026-12-06; it now connects from the thread that builds it unless given a CPU list."""
    try:
        adapter: Any = importlib.import_module("kvconn_vllm.connector")
    except ImportError:
        return
    connecting_on = adapter.connecting_on

    def on_the_kept_core(setting: str, suggested: Any = None) -> Any:
        if setting == "auto" and suggested is None:
            suggested = adapter._transfer_cpus()
        return connecting_on(setting, suggested)

    adapter.connecting_on = on_the_kept_core


def _idle_loads_move() -> None:
    """kvconn-mooncake-split: a load submitted while the engine idles goes to the step's
    cores over Mooncake too, as over LMDB, for a run where the client's threads are moved
    off the step's core: Mooncake declares no ``Capabilities.io_threads``, the flag that
    keeps its loads on the kept core, and the transfer service's own rule does the rest."""
    try:
        mooncake: Any = importlib.import_module("kvconn_mooncake")
    except ImportError:
        return
    backend = mooncake.MooncakeBackend
    backend.capabilities = dataclasses.replace(backend.capabilities, io_threads=False)


def _wait_after_report() -> None:
    """kvconn-lmdb-reportwait: an idle step waits as the adapter did before 2026-12-06,
    the whole ``idle_wait_s`` on a rank with no load in flight even right after it
    reported its loads, so a run measures both side by side."""
    try:
        adapter: Any = importlib.import_module("kvconn_vllm.connector")
    except ImportError:
        return
    wait_while_idle = adapter.wait_while_idle

    def wait_as_before(handles: Any, wait_s: float, *, reported: bool = False) -> None:
        wait_while_idle(handles, wait_s)

    adapter.wait_while_idle = wait_as_before


def _loads_on_the_kept_core() -> None:
    """kvconn-lmdb-keptloads: every load on the core vLLM keeps, as the adapter did
    before 2026-12-06, even one submitted in a step that computes nothing, so a run
    measures both side by side."""
    try:
        transfer: Any = importlib.import_module("kvconn.transfer")
    except ImportError:
        return
    load_many = transfer.TransferService.load_many

    def load_on_the_kept_core(self: Any, requests: Any, *, idle: bool = False) -> Any:
        return load_many(self, requests)

    transfer.TransferService.load_many = load_on_the_kept_core


if os.environ.get("BENCH_KVCONN_LOADS_ON_KEPT"):
    _loads_on_the_kept_core()
if os.environ.get("BENCH_KVCONN_CONNECT_ON_KEPT"):
    _connect_on_the_kept_core()
if os.environ.get("BENCH_KVCONN_IDLE_LOADS_MOVE"):
    _idle_loads_move()
if os.environ.get("BENCH_KVCONN_WAIT_AFTER_REPORT"):
    _wait_after_report()
if os.environ.get("BENCH_KVCONN_TIMINGS"):
    _time_background_transfers()
    _name_transfer_threads()
    _time_load_work()
    _time_collections()
    _note_modules()


class SlowLmdbBackend(LmdbBackend):
    """LMDB with ``delay_s`` added to every call that reaches the store.

    The delay sits in the backend's own hooks, where every public call ends, so it
    applies however the core reaches the store: ``exists`` (``_exists``), ``put``
    (``_put``), ``get`` and ``read`` (both end in ``_read_status``; ``_get`` calls it,
    so it is not delayed twice), ``borrow`` (``_borrow``: the core's loads on LMDB
    read borrowed views, not ``get``) and ``delete``. One delay per call, whatever
    the number of keys, as a store a round trip away would add.
    """

    name = "lmdb-slow"
    #: a store a round trip away, not one that answers from this host: a scheduler
    #: asks it through the lookup thread, under its deadline
    capabilities = dataclasses.replace(LmdbBackend.capabilities, local=False)

    def __init__(self, path: str | None = None, *, delay_s: float = 0.2, **options: Any) -> None:
        super().__init__(path, **options)
        self.delay_s = float(delay_s)

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        time.sleep(self.delay_s)
        return super()._exists(keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        time.sleep(self.delay_s)
        return super()._put(keys, values)

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        time.sleep(self.delay_s)
        return super()._read_status(keys, buffers, scratch=scratch)

    @contextlib.contextmanager
    def _borrow(self, keys: list[str]) -> Iterator[list[memoryview | None]]:
        time.sleep(self.delay_s)
        with super()._borrow(keys) as views:
            yield views

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        time.sleep(self.delay_s)
        return super()._delete(keys)
