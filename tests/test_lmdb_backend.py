"""The LMDB backend against a real LMDB environment on disk."""

import ctypes
import inspect
import itertools
import mmap
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from kvconn_lmdb import LmdbBackend

from kvconn.errors import BackendError, ConfigError
from kvconn.registry import load_backend
from kvconn.testing import BackendTests, ExactReadStatusTests
from kvconn.testing.processes import rank_context, start
from tests.helpers import native_threads


# the map holds every value this machine stores: a stored value is never unreachable
class TestLmdbConformance(BackendTests, ExactReadStatusTests):
    backend_name = "lmdb"

    @pytest.fixture
    def backend_options(self, tmp_path):
        return {"path": str(tmp_path / "store")}


def test_the_store_moves_bytes_on_the_calling_thread_and_declares_no_io_threads(tmp_path):
    """So an idle step's loads may run on the step's own core (kvconn.transfer)."""
    before = native_threads()
    backend = LmdbBackend(str(tmp_path / "kv"))
    try:
        assert backend.put(["k"], [b"v" * 4096]) == [True]
        out = bytearray(4096)
        assert backend.get(["k"], [out]) == [True] and bytes(out) == b"v" * 4096
        assert native_threads() <= before
        assert not LmdbBackend.capabilities.io_threads
    finally:
        backend.close()


def test_the_directory_is_created_owner_only(tmp_path):
    path = tmp_path / "a" / "b"
    load_backend("lmdb", {"path": str(path)}).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_the_default_path_is_under_the_users_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    backend = load_backend("lmdb", {})
    assert str(backend.path) == str(tmp_path / "kvconn" / "lmdb")  # type: ignore[attr-defined]
    backend.close()


def test_the_map_grows_when_full_instead_of_failing(tmp_path):
    backend = load_backend("lmdb", {"path": str(tmp_path), "map_size": 1 << 20})
    value = os.urandom(256 * 1024)
    keys = [f"grow/{i}" for i in range(40)]  # 10 MiB into a 1 MiB map
    assert backend.put(keys, [value] * 40) == [True] * 40
    assert all(backend.exists(keys))
    buf = bytearray(len(value))
    assert backend.get([keys[-1]], [buf]) == [True] and bytes(buf) == value
    backend.close()


def test_a_capped_map_that_fills_is_a_clear_backend_error(tmp_path):
    backend = load_backend(
        "lmdb", {"path": str(tmp_path), "map_size": 1 << 20, "max_map_size": 2 << 20}
    )
    with pytest.raises(BackendError, match="full at max_map_size"):
        backend.put([f"k/{i}" for i in range(20)], [os.urandom(256 * 1024)] * 20)
    assert backend.exists(["k/0"]) == [False]  # the failed batch stored nothing
    backend.close()


def test_two_handles_in_one_process_share_the_environment(tmp_path):
    a = load_backend("lmdb", {"path": str(tmp_path)})
    b = load_backend("lmdb", {"path": str(tmp_path)})
    a.put(["x"], [b"1"])
    a.close()
    assert b.exists(["x"]) == [True]  # closing one handle leaves the other working
    b.close()


def test_bad_options_are_rejected_naming_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown option.*bogus.*known: .*path"):
        load_backend("lmdb", {"path": str(tmp_path), "bogus": 1})
    with pytest.raises(ConfigError, match="map_size"):
        load_backend("lmdb", {"path": str(tmp_path), "map_size": 5})
    file_path = tmp_path / "file"
    file_path.write_text("x")
    with pytest.raises(ConfigError, match=r"cannot create directory|not a directory"):
        load_backend("lmdb", {"path": str(file_path)})


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs: a real full disk, where this machine lets root mount one."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_is_a_clear_error_and_keeps_what_was_stored(tiny_disk):
    backend = load_backend("lmdb", {"path": str(tiny_disk / "db"), "map_size": 1 << 20})
    value = os.urandom(256 * 1024)
    stored = []
    with pytest.raises(BackendError, match=r"disk holding .* is full"):
        for i in range(100):
            backend.put([f"k/{i}"], [value])
            stored.append(f"k/{i}")
    assert stored and all(backend.exists(stored))
    buf = bytearray(len(value))
    assert backend.get([stored[0]], [buf]) == [True] and bytes(buf) == value
    backend.close()


# ------------------------------------------------ damaged stores and bad options (issue 11)


def _store_with_pages(path, pages=40, size=64 * 1024):
    backend = load_backend("lmdb", {"path": str(path)})
    backend.put([f"k/{i}" for i in range(pages)], [os.urandom(size)] * pages)
    backend.close()
    return path / "data.mdb"


_LOOKUP_AFTER_OPEN = """
import sys
from kvconn.errors import KvconnError
from kvconn.registry import load_backend
try:
    backend = load_backend("lmdb", {"path": sys.argv[1]})
    buf = bytearray(64 * 1024)
    print(backend.exists(["k/39"]), backend.get(["k/39"], [buf]))
except KvconnError as exc:
    print(f"refused: {exc}")
"""


@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["half", "inside-the-second-meta-page"])
def test_a_truncated_data_file_is_refused_at_open_instead_of_killing_the_process(tmp_path, keep):
    """LMDB reads pages through a memory map: past the end of a cut-short file that is a
    SIGBUS (exit 135), not an error. The header names the last page in use, so the
    short file is refused before LMDB maps it; run in a subprocess, since the failure
    this guards against kills the interpreter."""
    data = _store_with_pages(tmp_path)
    os.truncate(data, max(1, int(data.stat().st_size * keep)))
    done = subprocess.run(
        [sys.executable, "-c", _LOOKUP_AFTER_OPEN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"died with {done.returncode}: {done.stderr[-400:]}"
    assert "refused: lmdb: the store at" in done.stdout
    assert "is damaged: data.mdb is" in done.stdout and "cut short" in done.stdout


def test_the_header_check_never_calls_a_store_damaged_while_another_process_commits(
    tmp_path, monkeypatch
):
    """A commit appends pages, then updates a meta. Reading the file's size before the
    metas raced with it: a commit landing in between made a whole store look cut short
    (88 false alarms in 20,000 checks against a busy writer, here). The commit is put
    exactly between the two reads."""
    import kvconn_lmdb
    import lmdb

    env = lmdb.open(str(tmp_path), map_size=1 << 28)
    real_fstat = os.fstat

    def fstat_then_commit(fd):
        result = real_fstat(fd)
        with env.begin(write=True) as txn:  # another process's commit lands here
            txn.put(b"late", os.urandom(256 * 1024))
        return result

    monkeypatch.setattr(os, "fstat", fstat_then_commit)  # os is shared: kvconn_lmdb reads it
    kvconn_lmdb.check_data_file(tmp_path)
    monkeypatch.undo()
    env.close()
    kvconn_lmdb.check_data_file(tmp_path)  # and the store is whole afterwards


def test_a_store_whose_file_is_whole_opens_after_the_header_check(tmp_path):
    _store_with_pages(tmp_path)
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    assert backend.exists(["k/0", "k/39", "k/40"]) == [True, True, False]
    backend.close()


def test_an_empty_path_is_refused_instead_of_opening_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="path must be a non-empty directory path"):
        load_backend("lmdb", {"path": ""})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("sync", "no", "sync must be true or false, got 'no'"),
        ("readonly", 1, "readonly must be true or false"),
        ("max_readers", -1, "max_readers must be an int between 1 and 65536, got -1"),
        ("max_readers", 2**40, "max_readers must be an int between 1 and 65536"),
        ("map_size", 2**70, "map_size must be an int between 1048576 and"),
        ("max_map_size", "x", "max_map_size must be an int between"),
        ("path", 5, "path must be a directory path, got 5"),
    ],
)
def test_bad_option_values_are_config_errors_naming_the_option(tmp_path, option, value, message):
    options = {"path": str(tmp_path / "store"), option: value}
    with pytest.raises(ConfigError, match=message):
        load_backend("lmdb", options)


def test_read_only_opening_of_a_missing_store_says_so_and_creates_nothing(tmp_path):
    missing = tmp_path / "typo"
    with pytest.raises(ConfigError, match=r"there is no store at .*typo"):
        load_backend("lmdb", {"path": str(missing), "readonly": True})
    assert not missing.exists()


def test_a_read_only_handle_reads_but_refuses_writes(tmp_path):
    _store_with_pages(tmp_path, pages=2)
    backend = load_backend("lmdb", {"path": str(tmp_path), "readonly": True})
    assert backend.exists(["k/1"]) == [True]
    with pytest.raises(BackendError, match="opened read-only"):
        backend.put(["new"], [b"x"])
    with pytest.raises(BackendError, match="opened read-only"):
        backend.delete(["k/1"])
    backend.close()
    writer = load_backend("lmdb", {"path": str(tmp_path)})
    assert writer.exists(["k/1", "new"]) == [True, False]
    writer.close()


def test_a_store_directory_others_can_write_is_used_with_a_warning(tmp_path, caplog):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o777)
    with caplog.at_level("WARNING", logger="kvconn"):
        load_backend("lmdb", {"path": str(path)}).close()
    warned = [r.getMessage() for r in caplog.records if "writable by" in r.getMessage()]
    assert warned and "group and others" in warned[0] and "0o777" in warned[0]
    caplog.clear()
    private = tmp_path / "private"
    with caplog.at_level("WARNING", logger="kvconn"):
        load_backend("lmdb", {"path": str(private)}).close()
    assert not [r for r in caplog.records if "writable by" in r.getMessage()]


def test_listing_skips_keys_other_programs_wrote_outside_kvconns_alphabet(tmp_path):
    """Issue 11: ``kvconn inspect`` died with UnicodeDecodeError on a non-UTF-8 key.
    Listed keys are the ones get/delete accept, as with the Redis backend."""
    import lmdb

    env = lmdb.open(str(tmp_path), map_size=1 << 24)  # another program, before kvconn
    foreign = [b"a/\xff\xfe", "a/caf\u00e9".encode(), b"a/with space", b"a/" + b"x" * 300]
    with env.begin(write=True) as txn:
        for key in foreign:
            txn.put(key, b"vv")
    env.close()
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.put(["a/1", "a/2"], [b"x", b"yy"])
    assert sorted(backend.list_keys("a/")) == [("a/1", 1), ("a/2", 2)]
    assert list(backend.list_keys("a/caf\u00e9")) == []
    escaped = "a/caf\u00e9".encode().decode("ascii", "surrogateescape")  # argv, C locale
    assert list(backend.list_keys(escaped)) == []
    backend.close()


# ------------------------------------------------ borrowed reads, page cache, durability


def test_borrowed_views_are_released_when_the_block_ends(tmp_path):
    """A view kept past its block would show pages LMDB may reuse (or unmap): it raises."""
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.put(["k"], [b"value"])
    with backend.borrow(["k", "absent"]) as views:
        kept = views[0]
        assert kept is not None and bytes(kept) == b"value" and views[1] is None
    with pytest.raises(ValueError, match="released"):
        bytes(kept)
    backend.close()


def test_borrowing_from_a_closed_backend_is_a_backend_error(tmp_path):
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.close()
    with pytest.raises(BackendError, match="closed"), backend.borrow(["k"]):
        pass


def _wait_for(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_growing_the_map_waits_until_another_threads_borrow_ends(tmp_path):
    """Growing the map remaps it, which would leave borrowed views pointing at unmapped
    memory (a crash on the next read of one): the put that must grow waits instead."""
    backend = LmdbBackend(tmp_path, map_size=1 << 20)
    value = os.urandom(64 * 1024)
    backend.put(["lent"], [value])
    big = [os.urandom(256 * 1024)] * 16  # 4 MiB: the 1 MiB map must grow
    done = threading.Event()
    errors = []

    def grow():
        try:
            backend.put([f"big/{i}" for i in range(16)], big)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    writer = threading.Thread(target=grow)
    with backend.borrow(["lent"]) as views:
        writer.start()
        _wait_for(lambda: backend._shared._remapping, "the writer to ask for a remap")
        assert not done.is_set()
        assert views[0] is not None and bytes(views[0]) == value  # mapped, same bytes
    writer.join(timeout=60)
    assert done.is_set() and not errors
    assert all(backend.exists([f"big/{i}" for i in range(16)]))
    backend.close()


def test_growing_the_map_inside_the_same_threads_borrow_is_an_error_not_a_deadlock(tmp_path):
    backend = load_backend("lmdb", {"path": str(tmp_path), "map_size": 1 << 20})
    backend.put(["lent"], [b"v"])
    with backend.borrow(["lent"]) as views:
        with pytest.raises(BackendError, match="finish the borrow block first"):
            backend.put([f"big/{i}" for i in range(16)], [os.urandom(256 * 1024)] * 16)
        assert views[0] is not None and bytes(views[0]) == b"v"
    assert backend.put(["after"], [os.urandom(4 << 20)]) == [True]  # grows now
    backend.close()


_GROW_FROM_ANOTHER_PROCESS = """
import os, sys
from kvconn.registry import load_backend
backend = load_backend("lmdb", {"path": sys.argv[1]})
backend.put([f"big/{i}" for i in range(16)], [os.urandom(256 * 1024)] * 16)
backend.close()
"""


def test_a_borrow_survives_another_process_growing_the_map(tmp_path):
    """Another process's remap is its own mapping; this one keeps the snapshot's pages.
    The next read here finds the map grown (MapResizedError) and adopts its size."""
    backend = load_backend("lmdb", {"path": str(tmp_path), "map_size": 1 << 20})
    value = os.urandom(64 * 1024)
    backend.put(["lent"], [value])
    with backend.borrow(["lent"]) as views:
        subprocess.run(
            [sys.executable, "-c", _GROW_FROM_ANOTHER_PROCESS, str(tmp_path)],
            check=True,
            timeout=120,
        )
        assert views[0] is not None and bytes(views[0]) == value
    assert all(backend.exists([f"big/{i}" for i in range(16)]))
    with backend.borrow(["big/15", "lent"]) as views:
        assert views[0] is not None and views[0].nbytes == 256 * 1024
        assert views[1] is not None and bytes(views[1]) == value
    backend.close()


def _resident_pages(path):
    """(resident, total) pages of a file in the page cache (mincore over a fresh map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


def _drop_from_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_exists_reads_the_index_not_the_values(tmp_path):
    """Issue 17: the first lookup in a new process took 76-190 ms. exists() fetched each
    value, and py-lmdb touches every 4 KiB page of a value it returns, so asking for 63
    pages of 768 KiB read 47 MiB from the page cache, or from disk. Found by a cursor,
    a key costs its B-tree pages and the head of its value."""
    keys = [f"k/{i}" for i in range(8)]
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.put(keys, [os.urandom(1 << 20)] * 8)
    backend.close()
    data = tmp_path / "data.mdb"
    _drop_from_page_cache(data)
    resident, total = _resident_pages(data)
    if resident > total // 10:
        pytest.skip(f"cannot drop this file from the page cache here ({resident}/{total} stay)")
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    assert backend.exists(keys) == [True] * 8
    resident, total = _resident_pages(data)
    backend.close()
    assert resident < total // 4, f"{resident} of {total} pages read to answer exists"


def _map_flags(path):
    """VmFlags of this process's mapping of ``path`` (``rr``: random, ``sr``: sequential)."""
    target = os.path.realpath(path)
    with open("/proc/self/smaps") as fh:
        lines = fh.read().splitlines()
    flags, inside = [], False
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            inside = fields[-1] == target
        elif inside and line.startswith("VmFlags:"):
            flags.append(set(fields[1:]))
    return flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc needed")
def test_the_map_is_read_ahead_only_while_values_are_copied(tmp_path):
    """Lookups touch scattered B-tree pages (readahead off); copies walk whole values
    (readahead on, or a cold value is read one 4 KiB fault at a time)."""
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.put(["k"], [b"v" * 10000])
    data = tmp_path / "data.mdb"
    assert backend.exists(["k"]) == [True]
    assert [f & {"rr", "sr"} for f in _map_flags(data)] == [{"rr"}]
    with backend.borrow(["k"]):
        assert [f & {"rr", "sr"} for f in _map_flags(data)] == [{"sr"}]
    assert [f & {"rr", "sr"} for f in _map_flags(data)] == [{"rr"}]
    backend.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux /proc needed")
def test_the_map_is_located_when_the_store_opens_not_at_the_first_load(tmp_path):
    """Finding the map reads /proc/self/maps (about a millisecond in an engine's
    process): at start-up, not on a fresh engine's first hit."""
    backend = LmdbBackend(tmp_path)
    shared = backend._shared
    assert shared._map_known and shared._map is not None
    assert shared._map[1] == shared.map_size
    backend.close()


_PUT_THEN_DIE = """
import os, signal, sys
from kvconn.registry import load_backend
backend = load_backend("lmdb", {"path": sys.argv[1]})
backend.put(["a", "b"], [b"x" * 100000, b"y"])
os.kill(os.getpid(), signal.SIGKILL)  # no close, no sync, no interpreter exit
"""


def test_a_process_killed_right_after_its_put_returned_loses_nothing(tmp_path):
    """``sync=False`` skips fsync, not the write: a committed put is in the kernel's page
    cache, which outlives the process. Only a system crash can lose it."""
    done = subprocess.run(
        [sys.executable, "-c", _PUT_THEN_DIE, str(tmp_path)], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    buf = bytearray(100000)
    assert backend.get(["a"], [buf]) == [True] and bytes(buf) == b"x" * 100000
    assert backend.exists(["b"]) == [True]
    backend.close()


@pytest.mark.parametrize("sync", [False, True])
def test_the_sync_option_decides_whether_each_commit_is_flushed(tmp_path, sync):
    backend = LmdbBackend(tmp_path, sync=sync)
    flags = backend._env.flags()
    assert (flags["sync"], flags["metasync"], flags["writemap"]) == (sync, sync, False)
    backend.close()


# ------------------------------------------------------ loads from borrowed values
def _lmdb_group(tmp_path, tp=2):
    import torch

    from kvconn.connector import Connector
    from kvconn.tools.models import minimax_m3
    from tests.helpers import fill_pool

    layout = minimax_m3(tp_size=tp, layers=2, num_slots=16)
    config = {"model": "m", "backend": "lmdb", "options": {"path": str(tmp_path / "s")}}
    group = []
    for rank in range(tp):
        pools = [torch.zeros(size, dtype=torch.uint8) for size in layout.pool_sizes]
        fill_pool(layout, rank, pools)
        group.append(Connector(config, layout, rank=rank, pools=pools))
    return layout, config, group


def test_a_load_from_lmdb_verifies_and_scatters_the_stored_bytes_without_copying_them_first(
    tmp_path, monkeypatch
):
    """Borrowed reads: the checksum is checked on the mapped value and the pages go
    straight into the slots; nothing is copied into staging (no ``get``)."""
    import torch

    from kvconn.connector import Connector
    from kvconn.hashing import block_hashes
    from tests.helpers import slot_bytes

    layout, config, writers = _lmdb_group(tmp_path)
    hashes = block_hashes(list(range(32 * 4)), 32)
    for w in writers:
        w.save(hashes, [1, 3, 5, 7])
    readers = [
        Connector(
            config,
            layout,
            rank=r,
            pools=[torch.zeros(s, dtype=torch.uint8) for s in layout.pool_sizes],
        )
        for r in range(2)
    ]
    for r in readers:
        monkeypatch.setattr(r.backend, "_get", lambda *a, **k: pytest.fail("copied via get"))
    for w, r in zip(writers, readers):
        assert r.load(hashes, [2, 4, 6, 8]).loaded == 4
        for src, dst in zip([1, 3, 5, 7], [2, 4, 6, 8]):
            assert slot_bytes(layout, r.pools, dst) == slot_bytes(layout, w.pools, src)
    for c in [*writers, *readers]:
        c.close()


def test_a_wrong_sized_value_lent_by_lmdb_fails_its_block_and_is_repaired(tmp_path):
    from kvconn.hashing import block_hashes

    _layout, _config, (conn, _) = _lmdb_group(tmp_path)
    hashes = block_hashes(list(range(32 * 3)), 32)
    conn.save(hashes, [1, 2, 3])
    key = conn.keys.rank_keys(0, hashes[1])[0]
    env = conn.backend._write_env()  # the test rewrites the stored value behind kvconn
    with env.begin(write=True) as txn:
        txn.put(key.encode(), b"short")
    result = conn.load(hashes, [4, 5, 6])
    assert result.loaded == 1
    assert conn.stats.pages("repaired") == 1
    assert conn.backend.exists([key]) == [False]
    conn.close()


def test_a_cancelled_borrowed_load_writes_nothing_more_into_the_slots(tmp_path):
    import contextlib

    import torch

    from kvconn.hashing import block_hashes
    from kvconn.slots import slot_map

    layout, _config, (conn, _) = _lmdb_group(tmp_path)
    hashes = block_hashes(list(range(32 * 3)), 32)
    conn.save(hashes, [1, 2, 3])
    before = [p.clone() for p in conn.pools]

    @contextlib.contextmanager
    def closed_gate(blocks):
        yield False

    slots = slot_map(layout, [4, 5, 6], hashes)
    result = conn.load_into(hashes, slots, lambda n: (None, None), gate=closed_gate)  # type: ignore[arg-type,return-value]
    assert result.loaded == 0
    assert all(torch.equal(a, b) for a, b in zip(before, conn.pools))
    conn.close()


def _scribble(conn, key: str) -> None:
    """Flip one byte of a stored value behind kvconn's back (same size: only the
    checksum can tell)."""
    env = conn.backend._write_env()
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key.encode()))
        value[len(value) // 2] ^= 0xFF
        txn.put(key.encode(), bytes(value))


def test_a_lent_load_stops_at_the_first_damaged_block_and_repairs_every_damaged_page(tmp_path):
    """Blocks are verified and scattered one by one (kvconn.lent_load): those before the
    damaged one load, it and every later block leave their slots untouched, and a damaged
    page further on is still found and deleted, as when a chunk was verified at once."""

    from kvconn.hashing import block_hashes
    from tests.helpers import slot_bytes

    layout, _config, (conn, other) = _lmdb_group(tmp_path)
    hashes = block_hashes(list(range(32 * 4)), 32)
    for writer in (conn, other):  # each writes its share of the shared pages
        writer.save(hashes, [1, 2, 3, 4])
    damaged = [conn.keys.rank_keys(0, hashes[b])[0] for b in (1, 3)]
    for key in damaged:
        _scribble(conn, key)
    before = [p.clone() for p in conn.pools]
    result = conn.load(hashes, [5, 6, 7, 8])
    assert (result.loaded, result.failed) == (1, (1, 2, 3))
    assert slot_bytes(layout, conn.pools, 5) == slot_bytes(layout, conn.pools, 1)
    for slot in (6, 7, 8):
        assert slot_bytes(layout, conn.pools, slot) == slot_bytes(layout, before, slot)
    assert conn.stats.pages("repaired") == 2
    assert conn.backend.exists(damaged) == [False, False]
    conn.close()
    other.close()


@pytest.mark.parametrize(
    ("group_bytes", "gate_opens", "entered", "loaded"),
    [
        (1, 2, [1, 1, 1], 2),  # a group per block: given up after two blocks
        (1 << 30, 1, [4], 4),  # one group: all four blocks pass the gate together
        (1 << 30, 0, [4], 0),  # ...or none of them, if it is already shut
    ],
)
def test_a_lent_load_cancelled_midway_keeps_the_blocks_already_written_and_no_more(
    tmp_path, monkeypatch, group_bytes, gate_opens, entered, loaded
):
    """The gate is entered per group of blocks (``GROUP_BYTES`` of pages): a load given
    up after some groups reports their blocks loaded, and the slots of the later blocks
    get no byte."""
    import contextlib

    from kvconn import lent_load
    from kvconn.hashing import block_hashes
    from kvconn.slots import slot_map
    from tests.helpers import slot_bytes

    monkeypatch.setattr(lent_load, "GROUP_BYTES", group_bytes)
    layout, _config, (conn, other) = _lmdb_group(tmp_path)
    hashes = block_hashes(list(range(32 * 4)), 32)
    for writer in (conn, other):  # each writes its share of the shared pages
        writer.save(hashes, [1, 2, 3, 4])
    before = [p.clone() for p in conn.pools]
    seen: list[int] = []

    @contextlib.contextmanager
    def gate(blocks):
        seen.append(blocks)
        yield len(seen) <= gate_opens

    slots = slot_map(layout, [5, 6, 7, 8], hashes)
    result = conn.load_into(hashes, slots, lambda n: (None, None), gate=gate)  # type: ignore[arg-type,return-value]
    assert result.loaded == loaded
    assert seen == entered
    for i, (src, dst) in enumerate(((1, 5), (2, 6), (3, 7), (4, 8))):
        want = conn.pools if i < loaded else before
        assert slot_bytes(layout, conn.pools, dst) == slot_bytes(
            layout, want, src if i < loaded else dst
        )
    conn.close()
    other.close()


# ------------------------------------------------ several threads (issue 17: thread_safe)


def _pattern(seed: int, size: int) -> bytes:
    block = bytes((seed * 31 + i) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


class _RecordingEnv:
    """The shared environment, recording how many reads of this process were inside the
    map each time it was remapped (must be 0: a remap unmaps what they point into)."""

    def __init__(self, shared: Any) -> None:
        self._shared = shared
        self._env = shared.env
        self.readers_at_remap: list[int] = []

    def set_mapsize(self, size: int) -> None:
        self.readers_at_remap.append(self._shared._readers)
        self._env.set_mapsize(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def _remaps_while_threads_read_and_borrow(path: str, queue: Any) -> None:
    """Run in a child process: a read of unmapped memory is a crash (an exit code), which
    the test reports instead of dying with it."""
    backend = LmdbBackend(path, map_size=1 << 20)
    shared = backend._shared
    fixed = [f"fixed/{i}" for i in range(6)]
    values = [_pattern(i, 40 * 1024 + i) for i in range(6)]
    backend.put(fixed, values)
    recording = _RecordingEnv(shared)
    shared.env = recording
    waited: list[int] = []  # reads in flight when each remap was asked for
    remap = shared.remap

    def counted_remap(size: int, where: Any) -> None:
        waited.append(shared._readers)
        remap(size, where)

    shared.remap = counted_remap  # type: ignore[method-assign,assignment]
    writing = threading.Event()
    writing.set()
    problems: list[str] = []
    reads = [0] * 3

    def reader(t: int) -> None:
        try:
            while writing.is_set():
                bufs = [bytearray(len(v)) for v in values]
                assert backend.get(fixed, bufs) == [True] * len(fixed)
                assert [bytes(b) for b in bufs] == values, "a get came back wrong"
                with backend.borrow(fixed) as views:
                    time.sleep(0)  # let a writer ask for a remap while the views are out
                    assert [bytes(v) for v in views if v is not None] == values
                assert backend.exists(fixed) == [True] * len(fixed)
                reads[t] += 1
        except BaseException as exc:
            problems.append(f"reader {t}: {exc!r}")

    def writer() -> None:
        try:
            for i in range(24):  # 12 MiB into a 1 MiB map: it grows again and again
                assert backend.put([f"fill/{i}"], [_pattern(100 + i, 512 * 1024)]) == [True]
        except BaseException as exc:
            problems.append(f"writer: {exc!r}")
        finally:
            writing.clear()

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(3)]
    threads.append(threading.Thread(target=writer))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    queue.put(
        {
            "hung": any(t.is_alive() for t in threads),
            "problems": problems,
            "reads": reads,
            "waited": waited,
            "readers_at_remap": recording.readers_at_remap,
        }
    )
    backend.close()


def test_remaps_forced_while_other_threads_read_and_borrow_never_unmap_their_values(tmp_path):
    """Growing the map unmaps it: a remap under a read or a borrowed view in another
    thread is a crash, not an error. Every remap must wait for the reads inside the map,
    and reads must wait for the remap. Run in a child process so that a crash fails the
    test instead of killing the test run."""
    ctx = rank_context()
    queue = ctx.Queue()
    proc = start(ctx, _remaps_while_threads_read_and_borrow, (str(tmp_path), queue))
    try:
        result = queue.get(timeout=300)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0, f"the child died with {proc.exitcode}"
    assert not result["hung"] and not result["problems"], result
    assert len(result["readers_at_remap"]) >= 3, result  # the map grew several times...
    assert set(result["readers_at_remap"]) == {0}, result  # ...never under a read
    assert max(result["waited"]) > 0, result  # and at least one remap had reads to wait for
    assert all(n > 0 for n in result["reads"]), result


def test_threads_writing_at_once_fill_the_map_and_grow_it_once_per_fullness(tmp_path, monkeypatch):
    """LMDB refuses to remap while a write transaction of the process is open, and two
    threads that find the map full must not both grow it: writes take turns, and a put
    that finds the map grown since it failed only retries."""
    backend = LmdbBackend(tmp_path, map_size=1 << 20)
    shared = backend._shared
    grown: list[tuple[int, int]] = []  # (size before, size after) of every remap
    remap = shared.remap

    def recorded_remap(size: int, where: Any) -> None:
        before = shared.env.info()["map_size"]
        remap(size, where)
        grown.append((before, shared.env.info()["map_size"]))

    monkeypatch.setattr(shared, "remap", recorded_remap)
    threads, puts, size = 4, 6, 256 * 1024
    barrier = threading.Barrier(threads)
    problems: list[str] = []

    def keys(t: int, i: int) -> list[str]:
        return [f"w/{t}/{i}/a", f"w/{t}/{i}/b"]

    def values(t: int, i: int) -> list[bytes]:
        return [_pattern(t * 100 + i, size), _pattern(t * 100 + i + 50, size - 1)]

    def write(t: int) -> None:
        try:
            barrier.wait(timeout=60)
            for i in range(puts):
                assert backend.put(keys(t, i), values(t, i)) == [True, True]
        except BaseException as exc:
            problems.append(f"thread {t}: {exc!r}")

    workers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(w.is_alive() for w in workers)
    assert not problems, problems
    for t in range(threads):
        for i in range(puts):
            bufs = [bytearray(len(v)) for v in values(t, i)]
            assert backend.get(keys(t, i), bufs) == [True, True]
            assert [bytes(b) for b in bufs] == values(t, i)
    assert len(grown) >= 3  # 12 MiB into a 1 MiB map
    for (before, after), (next_before, _) in itertools.pairwise(grown):
        assert before < after == next_before  # each growth from the size then in effect
    assert all(after <= max(2 * before, before + 4 * size) for before, after in grown)
    backend.close()


_HOLD_THE_WRITER = """
import select, sys, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 30)
txn = env.begin(write=True)
txn.put(b"other/process", b"x")
print("holding", flush=True)
ready, _, _ = select.select([sys.stdin], [], [], 60)
print("released" if ready else "timed out", flush=True)
txn.commit()
"""


def _waiting_in_write_begin(thread: threading.Thread) -> bool:
    """Whether ``thread`` is at the line of ``_put`` that begins the write transaction
    (there, LMDB waits for its writer mutex inside py-lmdb's C code)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code is not LmdbBackend._put.__code__:
        return False
    lines, first = inspect.getsourcelines(LmdbBackend._put)
    begin = next(i for i, line in enumerate(lines) if "env.begin(write=True)" in line)
    return frame.f_lineno == first + begin


def test_a_put_waiting_for_another_processs_writer_holds_up_no_other_thread(tmp_path):
    """While a put waits for LMDB's writer mutex (another process is writing), py-lmdb
    has released the GIL: this process's other threads read, borrow and look up as
    usual. Had it kept the GIL, nothing here would run until the other process gave up
    on its own after 60 s ("timed out")."""
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.put(["k"], [b"value"])
    other = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_WRITER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdin is not None and other.stdout is not None
    try:
        assert other.stdout.readline().strip() == "holding"
        outcome: dict[str, Any] = {}
        writer = threading.Thread(target=lambda: outcome.update(put=backend.put(["mine"], [b"n"])))
        writer.start()
        _wait_for(lambda: _waiting_in_write_begin(writer), "the put to wait for the writer")
        time.sleep(0.2)  # well inside LMDB's wait by now
        assert backend.exists(["k", "mine"]) == [True, False]
        buf = bytearray(5)
        assert backend.get(["k"], [buf]) == [True] and buf == b"value"
        with backend.borrow(["k"]) as views:
            assert views[0] is not None and bytes(views[0]) == b"value"
        assert not outcome and writer.is_alive()  # the put still waits for the other writer
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "released"
        writer.join(timeout=60)
        assert outcome == {"put": [True]}
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            other.kill()
    assert backend.exists(["other/process", "mine"]) == [True, True]
    backend.close()


def _close_under_a_borrow(path: str, queue: Any) -> None:
    """Run in a child process: closing the map under a view is a crash, not an error."""
    backend = LmdbBackend(path)
    value = _pattern(3, 300 * 1024)
    backend.put(["lent"], [value])
    lent, go = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def borrow() -> None:
        with backend.borrow(["lent"]) as views:
            lent.set()
            go.wait(timeout=60)
            time.sleep(0.1)  # close() is waiting by now, if it waits at all
            seen["view"] = bytes(views[0]) == value if views[0] is not None else None

    def close() -> None:
        backend.close()
        seen["closed_after_the_borrow"] = "view" in seen

    borrower = threading.Thread(target=borrow)
    borrower.start()
    lent.wait(timeout=60)
    closer = threading.Thread(target=close)
    closer.start()
    deadline = time.monotonic() + 60
    while not backend._shared._remapping and time.monotonic() < deadline:
        time.sleep(0.005)  # close() holds new reads off while it waits for this one
    seen["close_waited"] = closer.is_alive()
    go.set()
    borrower.join(timeout=60)
    closer.join(timeout=60)
    try:
        backend.exists(["lent"])
        seen["after"] = "answered"
    except BackendError as exc:
        seen["after"] = str(exc)
    queue.put(seen)


def test_close_waits_for_another_threads_borrow_and_later_calls_are_errors(tmp_path):
    ctx = rank_context()
    queue = ctx.Queue()
    proc = start(ctx, _close_under_a_borrow, (str(tmp_path), queue))
    try:
        seen = queue.get(timeout=120)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0, f"the child died with {proc.exitcode}"
    assert seen["close_waited"] and seen["view"] is True, seen
    assert seen["closed_after_the_borrow"], seen
    assert "closed" in seen["after"], seen


def test_every_reader_slot_taken_is_a_clear_error_and_reads_work_once_one_is_free(tmp_path):
    """Each read in flight holds a reader slot, in whichever thread or process it runs."""
    backend = LmdbBackend(tmp_path, max_readers=2)
    backend.put(["k"], [b"v"])
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with backend.borrow(["k"]):
            held.set()
            release.wait(timeout=60)

    other = threading.Thread(target=hold)
    other.start()
    held.wait(timeout=60)
    try:
        with (
            backend.borrow(["k"]),
            pytest.raises(BackendError, match=r"all 2 reader slots .* max_readers"),
        ):
            backend.exists(["k"])
    finally:
        release.set()
        other.join(timeout=60)
    assert backend.exists(["k"]) == [True]
    backend.close()


def test_a_listing_holds_no_read_between_pages_so_the_map_can_grow_meanwhile(tmp_path):
    """A listing used to hold one read transaction across all its ``yield``s, outside
    the remap coordination: a put that grew the map meanwhile invalidated it, and the
    listing failed ("Attempt to operate on closed/deleted/dropped object"). Holding the
    map for it instead would make every growth wait for a listing nobody finishes. Now
    each page of keys is its own read: a growth between two is fine, and the listing
    still yields every key once, in order."""
    backend = LmdbBackend(tmp_path, map_size=1 << 20)
    keys = sorted(f"list/{i:05d}" for i in range(2500))  # more than two pages
    backend.put(keys, [b"v"] * len(keys))
    listing = backend.list_keys("list/")
    first = [next(listing) for _ in range(10)]
    assert backend.put(["big"], [os.urandom(4 << 20)]) == [True]  # grows: no read held
    assert [k for k, _ in first + list(listing)] == keys
    backend.close()
