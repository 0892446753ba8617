"""LMDB backend: the embedded default, a directory on local disk.

LMDB gives multi-process readers and one writer at a time with crash-safe copy-on-write
pages, and its reads are pointers into a memory map, so a load copies once: from the
map straight into the caller's staging buffer, or not at all when the caller borrows
the values (``borrow``) and scatters from the map itself.

Threads: one backend may be called from several threads at once
(``Capabilities.thread_safe``). Reads run side by side and beside a write; writes of
this process take turns (LMDB has one writer), and growing the map waits for the reads
inside it, since a remap unmaps what they point into (:class:`_SharedEnv`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from kvconn.backend import Backend, Capabilities, ReadStatus
from kvconn.errors import BackendError, ConfigError

__all__ = ["LmdbBackend", "check_data_file", "default_path"]

log = logging.getLogger("kvconn")
T = TypeVar("T")

_GROWTH = 2
#: (pid, realpath) -> the environment every handle on that directory shares
_OPEN: dict[tuple[int, str], _SharedEnv] = {}
_OPEN_LOCK = threading.Lock()
#: How long growing the map waits for this process's reads still inside the old one.
_REMAP_WAIT_S = 60.0
#: A get of fewer bytes reads without readahead advice. Switching the advice costs 5-10
#: us a call (two madvise calls: ~5% of a 1 MiB get); from a cold page cache a 4 MiB
#: batch is ~1,000 single-page faults without it, a few large reads with it.
_READ_AHEAD_MIN_BYTES = 4 << 20
#: Keys listed per read transaction (``_list``): a few ms of work each.
_LIST_PAGE = 1024

#: Bounds only a typo reaches. The map is reserved address space (128 TiB on x86-64);
#: each reader slot is 64 bytes of the lock file.
MAX_MAP_SIZE = 1 << 46  # 64 TiB
MAX_READERS = 1 << 16

#: LMDB's file header (mdb.c, data format version 1): each of the first two pages is a
#: page header followed by a meta record; the meta with the larger transaction id is
#: current. Native sizes and alignment, as LMDB writes them.
_PAGE_HEADER = struct.Struct("@NHHHH")  # page number, pad, flags, lower, upper
_DB = "IHHNNNNN"  # pad (the page size, in the free-page DB), flags, depth, 4 counts, root
_META = struct.Struct("@IIPN" + _DB + _DB + "NN")  # magic, version, address, map size,
# free-page DB, main DB, last used page, transaction id
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
#: The bytes of keys the backend contract accepts: printable ASCII without the space.
_KEY_ALPHABET = bytes(range(0x21, 0x7F))


def default_path() -> Path:
    """``$XDG_CACHE_HOME/kvconn/lmdb`` (``~/.cache/kvconn/lmdb``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvconn" / "lmdb"


def _meta(raw: bytes) -> tuple[int, int, int] | None:
    """(page size, last used page, transaction id) of one meta page, or None if not one."""
    if len(raw) < _PAGE_HEADER.size + _META.size:
        return None
    fields = _META.unpack_from(raw, _PAGE_HEADER.size)
    magic, version, page_size, last_page, txnid = (
        fields[0],
        fields[1],
        fields[4],
        fields[-2],
        fields[-1],
    )
    if magic != _MAGIC or version != _DATA_VERSION:
        return None
    if page_size < 512 or page_size > 1 << 16 or page_size & (page_size - 1):
        return None
    return page_size, last_page, txnid


def check_data_file(directory: Path) -> None:
    """Refuse a ``data.mdb`` shorter than the pages its header says are in use.

    LMDB maps the file and reads pages through the map: a page past the end of a
    truncated file (a full disk, an interrupted copy) is not an error it can return but
    a SIGBUS that kills the process. So the header is read with plain file reads,
    before LMDB maps anything. A missing or empty file is a new store; a file that is
    not LMDB's (another format version) is left for LMDB to refuse.
    """
    data = directory / "data.mdb"
    need = _PAGE_HEADER.size + _META.size
    try:
        with open(data, "rb") as fh:
            first = _meta(fh.read(need))
            if first is None:
                return  # empty (a new store), or not a file this check understands
            page_size = first[0]
            fh.seek(page_size)
            second = _meta(fh.read(need))
            # The size after the metas: a writer in another process appends its pages
            # before it updates a meta, so a meta read first never names a page past
            # the size read after it (the other order races with a commit).
            size = os.fstat(fh.fileno()).st_size
    except OSError:
        return  # absent or unreadable: LMDB creates it or reports why it cannot
    metas = [m for m in (first, second) if m is not None]
    last_page = max(m[1] for m in metas)
    required = max(2, last_page + 1) * page_size
    if size < required:
        raise BackendError(
            f"lmdb: the store at {directory} is damaged: data.mdb is {size} bytes, but its "
            f"header says pages up to {last_page} of {page_size} bytes are in use "
            f"({required} bytes). The file was cut short (a full disk, an interrupted "
            f"copy?); reading it would crash the process with SIGBUS, so it is not "
            f"opened. Move it aside or delete {directory} to start an empty store."
        )


def _check_permissions(directory: Path) -> None:
    """Warn when others may write the store: they could replace pages this process serves."""
    for where in (directory, directory / "data.mdb"):
        try:
            mode = stat.S_IMODE(os.stat(where).st_mode)
        except OSError:
            continue
        writers = [who for who, bit in (("group", 0o020), ("others", 0o002)) if mode & bit]
        if writers:
            log.warning(
                "kvconn: lmdb: %s is writable by %s (mode %s): anyone who can write there "
                "can replace cached KV pages that kvconn then serves; chmod go-w it",
                where,
                " and ".join(writers),
                oct(mode),
            )


def _madvise_function() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None where it cannot be called (the advice is only a hint)."""
    if not hasattr(mmap, "MADV_SEQUENTIAL") or not hasattr(mmap, "MADV_RANDOM"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_madvise = _madvise_function()


def find_map(data_file: Path, length: int) -> tuple[int, int] | None:
    """Address and length of this process's mapping of ``data_file`` (LMDB's map).

    py-lmdb does not say where the map is (``info()["map_addr"]`` is only LMDB's fixed
    address, 0), so it is read from ``/proc/self/maps`` (Linux): the mapping of that
    file whose extent is ``length`` bytes. None when there is no such single mapping.
    """
    try:
        target = os.path.realpath(data_file)
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as fh:
            text = fh.read()
    except OSError:
        return None
    extents: dict[int, int] = {}  # map base -> end; a map split by advice has one base
    # Only the lines naming the file are split: an engine's process maps hundreds of
    # libraries, and splitting every line took most of a millisecond.
    at = text.find(target)
    while at != -1:
        begin = text.rfind("\n", 0, at) + 1
        end_of_line = text.find("\n", at)
        line = text[begin : len(text) if end_of_line == -1 else end_of_line]
        at = text.find(target, at + len(target))
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] != target:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        base = start - int(fields[2], 16)
        extents[base] = max(extents.get(base, end), end)
    found = [(base, end - base) for base, end in extents.items() if end - base == length]
    return found[0] if len(found) == 1 else None


class _SharedEnv:
    """One LMDB environment per (process, directory), shared by every handle on it.

    LMDB forbids opening an environment twice in a process, so handles share it, and
    with it the threads of the process that call them (the backend is
    ``Capabilities.thread_safe``). What they must coordinate, all under one condition
    variable that is never held across an LMDB call that waits:

    * **Remaps.** Growing the map (``set_mapsize``) unmaps the memory that this
      process's read transactions and borrowed views point into: py-lmdb invalidates
      open transactions, and a view read after that is a crash, not an error. So a
      remap waits until no read of this process is inside the map, and reads wait while
      one runs (or is waited for, so a stream of reads cannot starve it). (Other
      processes remap their own mappings; the snapshot a read transaction holds stays
      in this one.)
    * **Writes.** One write transaction of this process at a time (:meth:`writing`),
      held across a put's growth and retry. LMDB allows only one writer anyway (its
      writer mutex, shared with other processes), and ``set_mapsize`` must not run while
      a write transaction of this process is open (LMDB answers ``EINVAL``), so a put
      that grows the map must keep other threads from beginning one meanwhile. It also
      means two threads that find the map full never both grow it: the second finds it
      grown already (:meth:`grow`). py-lmdb releases the GIL while ``begin`` waits for
      LMDB's writer mutex and while ``commit`` runs (measured: ~2,000 reads of another
      thread completed during each 100 ms synced commit), so a writer waiting on another
      process stops no other thread of this one, and none deadlocks on the GIL.
    * **Closing.** :meth:`close` waits for the write in flight and for other threads'
      reads to leave the map; closing under them would free memory they still use.
    * **Readahead advice.** The map is opened with readahead off (``MADV_RANDOM``): a
      lookup touches one B-tree page here and there, and the kernel's read-around
      would read megabytes around each (``read_ahead_kb`` is 8 MiB on some virtual
      disks). A read that copies values walks each value front to back, so while one
      runs the map is advised ``MADV_SEQUENTIAL``: a value not in the page cache is read
      in large requests instead of one 4 KiB fault at a time (measured ~10x faster for
      63 values of 768 KiB from a cold cache, docs/performance.md). The advice is the
      mapping's, so a lookup running meanwhile in another thread reads ahead too: only
      slower from a cold cache, never wrong.
    """

    def __init__(self, env: Any, writable: bool, data_file: Path) -> None:
        self.env = env
        self.count = 1
        self.writable = writable
        self._data_file = data_file
        self._cond = threading.Condition()
        self._readers = 0  # read transactions of this process inside the map
        self._remapping = False
        self._writer: int | None = None  # the thread holding the write side
        self._closed = False
        self._held = threading.local()  # reads the current thread holds
        self._reading_ahead = 0  # reads walking whole values: the map is sequential
        self._map: tuple[int, int] | None = None
        self._map_known = False
        #: The map size this process has mapped; changed only by :meth:`remap`.
        self.map_size = int(env.info()["map_size"])
        # Where the map is, found now (reading /proc/self/maps, about a millisecond in an
        # engine's process), not in a fresh engine's first load of a hit.
        self._locate_map()

    def _held_here(self) -> int:
        return getattr(self._held, "n", 0)  # type: ignore[no-any-return]

    def _check_open(self, path: Path) -> None:
        if self._closed:
            raise BackendError(f"lmdb: {path} was closed while this call waited")

    @contextlib.contextmanager
    def reading(self, read_ahead: bool, path: Path) -> Iterator[None]:
        """Hold the map in place (no remap) for one read; advise it for value copies."""
        with self._cond:
            # A thread already inside a read (a borrow block that reads again) must not
            # wait for a remap that waits for it.
            while self._remapping and not self._held_here():
                self._cond.wait()
            self._check_open(path)
            self._readers += 1
            if read_ahead:
                self._reading_ahead += 1
                if self._reading_ahead == 1:
                    self._advise("MADV_SEQUENTIAL")
        self._held.n = self._held_here() + 1
        try:
            yield
        finally:
            self._held.n -= 1
            with self._cond:
                self._readers -= 1
                if read_ahead:
                    self._reading_ahead -= 1
                    if self._reading_ahead == 0:
                        self._advise("MADV_RANDOM")
                if self._readers == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self, path: Path) -> Iterator[None]:
        """The write side of this process: one write transaction (or remap) at a time.

        A thread that holds reads (a borrow block) and waits here while the holder
        remaps would wait for a remap that waits for it: it fails at once instead.
        """
        me = threading.get_ident()
        with self._cond:
            while self._writer is not None:
                if self._remapping and self._held_here():
                    raise BackendError(
                        f"lmdb: the map of {path} is being remapped by another thread, which "
                        "waits for the values this thread has borrowed; finish the borrow "
                        "block first"
                    )
                self._cond.wait()
            self._check_open(path)
            self._writer = me
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._cond.notify_all()

    def _advise(self, advice: str) -> None:
        """Called with the lock held and the map in place (no remap can run). Only a
        hint: whatever fails here leaves the map as it was, never fails the read."""
        if _madvise is None:
            return
        if not self._map_known:
            self._locate_map()
        if self._map is not None:
            _madvise(self._map[0], self._map[1], getattr(mmap, advice))

    def _locate_map(self) -> None:
        """Find the map's address and length for :meth:`_advise` (again after a remap)."""
        if _madvise is None:
            return
        try:
            length = self.env.info()["map_size"]
        except Exception:  # a closed environment: the read itself will say so
            return
        self._map = find_map(self._data_file, length)
        self._map_known = True

    def grow(self, seen: int, batch_bytes: int, max_map_size: int | None, path: Path) -> None:
        """Grow a map that was ``seen`` bytes when a put found it full (write side held).

        If it has grown since (another put's growth, or a remap adopting another
        process's size), the put only retries: a full map is grown once, not once per
        thread that found it full.
        """
        if self.map_size > seen:
            return
        current = self.map_size
        target = max(current * _GROWTH, current + 2 * batch_bytes)
        if max_map_size is not None:
            if current >= max_map_size:
                raise BackendError(f"lmdb: {path} is full at max_map_size={max_map_size} bytes")
            target = min(target, max_map_size)
        self.remap(target, path)

    def remap(self, size: int, path: Path) -> None:
        """``set_mapsize(size)`` once no read of this process is inside the map.

        The caller holds the write side (:meth:`writing`): LMDB refuses a remap while a
        write transaction of this process is open. ``size`` 0 adopts the size another
        process grew the map to.
        """
        if self._writer != threading.get_ident():
            raise AssertionError("lmdb: remap without the write side")
        if self._held_here():
            raise BackendError(
                f"lmdb: the map of {path} must be remapped, but this thread holds values "
                "borrowed from it; finish the borrow block first"
            )
        deadline = time.monotonic() + _REMAP_WAIT_S
        with self._cond:
            self._remapping = True
            self._cond.notify_all()  # writers waiting with borrowed values must give up
            try:
                while self._readers:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BackendError(
                            f"lmdb: waited {_REMAP_WAIT_S:.0f} s to remap {path} while other "
                            "threads of this process kept reading (or borrowing) from it"
                        )
                    self._cond.wait(left)
                self._check_open(path)
            except BaseException:
                self._remapping = False
                self._cond.notify_all()
                raise
        try:
            self.env.set_mapsize(size)
            self.map_size = int(self.env.info()["map_size"])
        finally:
            with self._cond:
                self._remapping = False
                self._map_known = False  # the map may have moved
                self._cond.notify_all()

    def close(self) -> bool:
        """Close the environment once the write in flight and other threads' reads are
        done; whether it was closed.

        After ``_REMAP_WAIT_S`` of waiting it is left open with a warning: closing under
        a call that is still inside LMDB would crash the process.
        """
        deadline = time.monotonic() + _REMAP_WAIT_S
        with self._cond:
            while self._writer is not None or self._remapping:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    break
            busy = self._writer is not None or self._remapping
            if not busy:
                self._remapping = True  # new reads wait, then find the environment closed
                self._writer = threading.get_ident()  # and so do new writes
                while self._readers > self._held_here():
                    if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                        break
                busy = self._readers > self._held_here()
                if not busy:
                    self.env.close()
                    self._closed = True
                self._remapping = False
                self._writer = None
                self._cond.notify_all()
        if busy:
            log.warning(
                "kvconn: lmdb: %s left open: another thread was still inside a call after "
                "%.0f s (close the backend once no call runs)",
                self._data_file.parent,
                _REMAP_WAIT_S,
            )
        return not busy


class LmdbBackend(Backend):
    name: ClassVar[str] = "lmdb"
    extra: ClassVar[str | None] = "lmdb"
    client_modules: ClassVar[tuple[str, ...]] = ("lmdb",)
    #: thread_safe: reads overlap each other and a write; writes, remaps and close
    #: take turns (see :class:`_SharedEnv`). local: an exists is a walk of the memory
    #: map's B-tree, a few microseconds per key once its pages are in memory.
    capabilities: ClassVar[Capabilities] = Capabilities(
        delete=True, listing=True, borrowed_reads=True, thread_safe=True, local=True
    )
    max_key_length: ClassVar[int] = 250  # LMDB allows 511; keep the common limit

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        map_size: int = 1 << 30,
        max_map_size: int | None = None,
        sync: bool = False,
        max_readers: int = 512,
        readonly: bool = False,
    ) -> None:
        """Open (creating if needed) the store at ``path``.

        ``sync=False`` keeps LMDB's integrity guarantees but may lose the last commits on
        a machine crash: right for a cache, where a lost page is only a miss.
        ``readonly=True`` opens an existing store without creating or changing anything
        (``kvconn inspect``); a path with no store is then an error.
        """
        import lmdb

        self._lmdb = lmdb
        self._closed = True  # until opened: close() is then a no-op
        for name, value in (("sync", sync), ("readonly", readonly)):
            if not isinstance(value, bool):
                raise ConfigError(f"lmdb: {name} must be true or false, got {value!r}")
        _check_size("map_size", map_size, 1 << 20)
        if max_map_size is not None:
            _check_size("max_map_size", max_map_size, map_size)
        if (
            isinstance(max_readers, bool)
            or not isinstance(max_readers, int)
            or not 1 <= max_readers <= MAX_READERS
        ):
            raise ConfigError(
                f"lmdb: max_readers must be an int between 1 and {MAX_READERS}, got {max_readers!r}"
            )
        self.path = _store_path(path)
        self._readonly = readonly
        if readonly:
            if not (self.path / "data.mdb").is_file():
                raise ConfigError(f"lmdb: there is no store at {self.path} (no data.mdb there)")
        else:
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"lmdb: cannot create directory {self.path}: {exc}") from exc
        if not self.path.is_dir():
            raise ConfigError(f"lmdb: {self.path} is not a directory")
        self._max_map_size = max_map_size
        self._map_size = map_size
        self._sync = sync
        self._max_readers = max_readers
        self._key = (os.getpid(), os.path.realpath(self.path))
        self._shared = self._acquire()
        self._env = self._shared.env
        self._closed = False

    # LMDB forbids opening one environment twice in a process (its locks are per
    # process); share one handle per (process, path) and never reuse one across fork.
    def _acquire(self) -> _SharedEnv:
        with _OPEN_LOCK:
            shared = _OPEN.get(self._key)
            if shared is not None:
                if not shared.writable and not self._readonly:
                    raise ConfigError(
                        f"lmdb: {self.path} is already open read-only in this process; "
                        "close that handle before opening it for writing"
                    )
                shared.count += 1
                return shared
            check_data_file(self.path)
            _check_permissions(self.path)
            try:
                env = self._lmdb.open(
                    str(self.path),
                    map_size=self._map_size,
                    subdir=True,
                    readonly=self._readonly,
                    create=not self._readonly,
                    max_dbs=0,
                    lock=True,
                    readahead=False,
                    meminit=False,
                    sync=self._sync,
                    metasync=self._sync,
                    max_readers=self._max_readers,
                    mode=0o600,
                )
            except self._lmdb.Error as exc:
                raise BackendError(f"lmdb: cannot open {self.path}: {exc}") from exc
            shared = _SharedEnv(env, not self._readonly, self.path / "data.mdb")
            _OPEN[self._key] = shared
            return shared

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if os.getpid() != self._key[0]:
            # Inherited across fork: closing would drop the parent's LMDB locks (they
            # are per process and per file), so the child only forgets the handle.
            return
        with _OPEN_LOCK:
            shared = _OPEN[self._key]
            shared.count -= 1
            if shared.count == 0 and shared.close():
                del _OPEN[self._key]
            # else: left open (a call still inside it) and reused by the next open

    def _write_env(self) -> Any:
        if self._readonly:
            raise BackendError(f"lmdb: {self.path} was opened read-only")
        return self._txn_env()

    def _txn_env(self) -> Any:
        if self._closed:
            raise BackendError("lmdb: the backend is closed")
        if os.getpid() != self._key[0]:
            raise BackendError(
                "lmdb: this backend was opened in another process; open a new one after fork"
            )
        return self._env

    @contextlib.contextmanager
    def _read_txn(self, read_ahead: bool) -> Iterator[Any]:
        """One read transaction (``buffers=True``: values are views into the map).

        If another process grew the map past this process's mapping, LMDB refuses the
        transaction (``MapResizedError``): adopt the new size and begin again. Each read
        in flight holds one of the ``max_readers`` slots, which every thread of every
        process using the store shares.
        """
        env = self._txn_env()
        for attempt in range(2):
            with self._shared.reading(read_ahead, self.path):
                try:
                    txn = env.begin(buffers=True)
                except self._lmdb.MapResizedError:
                    if attempt:
                        raise BackendError(f"lmdb: {self.path} keeps being resized") from None
                    txn = None
                except self._lmdb.ReadersFullError:
                    raise BackendError(
                        f"lmdb: all {env.max_readers()} reader slots of {self.path} are taken "
                        "(MDB_READERS_FULL): each read in flight, in any thread of any process "
                        "using the store, holds one; open it with a larger max_readers (while "
                        "other processes have it open, it keeps the count they opened it with)"
                    ) from None
                except self._lmdb.Error as exc:
                    raise BackendError(f"lmdb: read failed in {self.path}: {exc}") from exc
                if txn is not None:
                    try:
                        yield txn
                    finally:
                        with contextlib.suppress(self._lmdb.Error):
                            txn.abort()
                    return
            with self._shared.writing(self.path):  # outside the read: a remap waits for
                self._remap(0)  # reads to leave the map

    def _read(self, fn: Callable[[Any], list[T]], *, read_ahead: bool) -> list[T]:
        with self._read_txn(read_ahead) as txn:
            try:
                return fn(txn)
            except self._lmdb.Error as exc:
                raise BackendError(f"lmdb: read failed in {self.path}: {exc}") from exc

    def _remap(self, size: int) -> None:
        try:
            self._shared.remap(size, self.path)
        except self._lmdb.Error as exc:
            raise BackendError(f"lmdb: cannot remap {self.path}: {exc}") from exc

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        encoded = [k.encode() for k in keys]

        def ask(txn: Any) -> list[bool]:
            # A cursor finds the key without fetching the value: py-lmdb's get() touches
            # every 4 KiB page of the value before it returns (its "preload"), so an
            # exists() of 63 values of 768 KiB faulted in 47 MiB, 12,096 pages, where
            # the B-tree needs ~2 pages a key (docs/performance.md, first lookup).
            cursor = txn.cursor()
            return [cursor.set_key(k) for k in encoded]

        return self._read(ask, read_ahead=False)

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        loaded = ReadStatus.LOADED
        return [s is loaded for s in self._read_status(keys, buffers, scratch=scratch)]

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        """Each value copied from the map into its buffer when the sizes match.

        The store can tell why a key failed: absent (``MISSING``) or stored with another
        size (``WRONG_SIZE``, whose buffer stays untouched). There is no third case: a
        value lives in this machine's map, so it is never stored-but-unreachable, and an
        error reading the map fails the whole call (``BackendError``).
        """
        encoded = [k.encode() for k in keys]
        loaded, missing, wrong_size = ReadStatus.LOADED, ReadStatus.MISSING, ReadStatus.WRONG_SIZE

        def copy(txn: Any) -> list[ReadStatus]:
            out = []
            for key, buf in zip(encoded, buffers):
                value = txn.get(key)
                if value is None:
                    out.append(missing)
                elif len(value) != buf.nbytes:
                    out.append(wrong_size)
                else:
                    buf[:] = value  # straight from the memory map into the caller's buffer
                    out.append(loaded)
            return out

        big = sum(buf.nbytes for buf in buffers) >= _READ_AHEAD_MIN_BYTES
        return self._read(copy, read_ahead=big)

    @contextlib.contextmanager
    def _borrow(self, keys: list[str]) -> Iterator[list[memoryview | None]]:
        """Views into the map, held by one read transaction for the whole block.

        The transaction's reader slot pins its snapshot: pages it shows are not reused
        by writers in any process until it ends, so the views keep their bytes while
        others write or delete; this process does not remap meanwhile (``_SharedEnv``).
        The views are released when the block ends, so a view used later raises
        ``ValueError`` instead of reading memory LMDB may have reused. Always read with
        readahead: the sizes are unknown until the values are fetched (which faults them
        in), and a borrow is a load's whole batch.
        """
        encoded = [k.encode() for k in keys]
        with self._read_txn(read_ahead=True) as txn:
            try:
                views: list[memoryview | None] = [txn.get(k) for k in encoded]
            except self._lmdb.Error as exc:
                raise BackendError(f"lmdb: read failed in {self.path}: {exc}") from exc
            try:
                yield views
            finally:
                for view in views:
                    if view is not None:
                        try:
                            view.release()
                        except BufferError:  # exported to an object still alive
                            log.warning(
                                "kvconn: lmdb: a borrowed value is still in use after its "
                                "borrow block ended; it may change or vanish under it"
                            )

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        encoded = [k.encode() for k in keys]
        env = self._write_env()
        lmdb = self._lmdb
        shared = self._shared
        with shared.writing(self.path):  # held across growth and retry: see _SharedEnv
            while True:
                seen = shared.map_size
                try:
                    with env.begin(write=True) as txn:
                        for key, value in zip(encoded, values):
                            txn.put(key, value, overwrite=False)  # first writer wins
                    return [True] * len(keys)
                except lmdb.MapFullError:
                    batch_bytes = sum(v.nbytes for v in values)
                    try:
                        shared.grow(seen, batch_bytes, self._max_map_size, self.path)
                    except lmdb.Error as exc:
                        raise self._write_error(exc, batch_bytes) from exc
                except lmdb.MapResizedError:
                    self._remap(0)
                except (lmdb.Error, OSError) as exc:
                    raise self._write_error(exc, sum(v.nbytes for v in values)) from exc

    def _write_error(self, exc: BaseException, batch_bytes: int = 0) -> BackendError:
        # LMDB often reports a full disk as EIO from mdb_txn_commit, so ask the file
        # system how much room is left rather than trusting the error code alone.
        code = getattr(exc, "errno", None)
        text = str(exc)
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = -1
        if code == errno.ENOSPC or "No space left" in text or 0 <= free < batch_bytes + (1 << 20):
            return BackendError(
                f"lmdb: the disk holding {self.path} is full ({max(free, 0)} bytes free): {text}"
            )
        return BackendError(f"lmdb: write failed in {self.path}: {text}")

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        env = self._write_env()
        with self._shared.writing(self.path):
            for attempt in range(2):
                try:
                    with env.begin(write=True) as txn:
                        return [bool(txn.delete(k.encode())) for k in keys]
                except self._lmdb.MapResizedError:  # another process grew the map
                    if attempt:
                        raise BackendError(f"lmdb: {self.path} keeps being resized") from None
                    self._remap(0)
                except self._lmdb.Error as exc:
                    raise self._write_error(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """Keys the backend contract can address; keys other programs wrote outside
        kvconn's alphabet (not printable ASCII, spaces, too long) are skipped, as the
        Redis backend skips them, instead of failing to decode. A prefix read under a
        C locale (surrogate escapes) is matched as the bytes that were typed.

        One read transaction per page of keys, never held across a ``yield``: a caller
        that consumes the listing slowly (or not at all) would otherwise hold a reader
        slot and keep every remap of this process waiting. Like Redis's ``SCAN``, a key
        written or deleted meanwhile may or may not be listed; every key present for the
        whole listing is listed once.
        """
        start = prefix.encode("utf-8", "surrogateescape")
        after: bytes | None = None
        while True:
            page, last = self._list_page(start, after)
            yield from page
            if last is None:
                return
            after = last

    def _list_page(
        self, start: bytes, after: bytes | None
    ) -> tuple[list[tuple[str, int]], bytes | None]:
        """Up to ``_LIST_PAGE`` keys under ``start`` past ``after``, and the last key seen
        (None when the listing is done)."""

        def page(txn: Any) -> tuple[list[tuple[str, int]], bytes | None]:
            cursor = txn.cursor()
            if not cursor.set_range(after if after is not None else start):
                return [], None
            if after is not None and bytes(cursor.key()) == after and not cursor.next():
                return [], None
            out: list[tuple[str, int]] = []
            for seen, (key, value) in enumerate(cursor, 1):
                key_bytes = bytes(key)
                if not key_bytes.startswith(start):
                    return out, None
                if len(key_bytes) <= self.max_key_length and not key_bytes.translate(
                    None, _KEY_ALPHABET
                ):
                    out.append((key_bytes.decode("ascii"), len(value)))
                if seen == _LIST_PAGE:
                    return out, key_bytes
            return out, None

        with self._read_txn(read_ahead=False) as txn:
            try:
                return page(txn)
            except self._lmdb.Error as exc:
                raise BackendError(f"lmdb: listing failed in {self.path}: {exc}") from exc


def _check_size(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_MAP_SIZE:
        raise ConfigError(
            f"lmdb: {name} must be an int between {low} and {MAX_MAP_SIZE} bytes (64 TiB), "
            f"got {value!r}"
        )


def _store_path(path: object) -> Path:
    """The store directory; ``''`` is refused rather than read as the working directory."""
    if path is None:
        return default_path()
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"lmdb: path must be a directory path, got {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip() or "\0" in text:
        raise ConfigError(f"lmdb: path must be a non-empty directory path, got {text!r}")
    return Path(text).expanduser()
