"""The LMDB backend against a real LMDB environment on disk."""

import ctypes
import mmap
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
from kvconn_lmdb import LmdbBackend

from kvconn.backend import ReadStatus
from kvconn.errors import BackendError, ConfigError
from kvconn.registry import load_backend
from kvconn.testing import BackendTests


class TestLmdbConformance(BackendTests):
    backend_name = "lmdb"

    @pytest.fixture
    def backend_options(self, tmp_path):
        return {"path": str(tmp_path / "store")}


def test_a_read_says_missing_for_an_absent_key_and_wrong_size_for_another_length(tmp_path):
    """The map holds every value this machine stores, so a stored value is never
    ``UNREACHABLE``: a key that did not load is absent or of another size."""
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    backend.put(["six", "ok"], [b"sixsix", b"ok"])
    for scratch in (False, True):
        bufs = [bytearray(5), bytearray(7), bytearray(6), bytearray(2)]
        assert backend.read(["six", "six", "absent", "ok"], bufs, scratch=scratch) == [
            ReadStatus.WRONG_SIZE,
            ReadStatus.WRONG_SIZE,
            ReadStatus.MISSING,
            ReadStatus.LOADED,
        ]
        assert bufs[:3] == [bytearray(5), bytearray(7), bytearray(6)]  # untouched
        assert bufs[3] == b"ok"
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
