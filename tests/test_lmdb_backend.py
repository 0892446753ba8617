"""The LMDB backend against a real LMDB environment on disk."""

import os
import stat
import subprocess
import sys

import pytest

from kvconn.errors import BackendError, ConfigError
from kvconn.registry import load_backend
from kvconn.testing import BackendTests


class TestLmdbConformance(BackendTests):
    backend_name = "lmdb"

    @pytest.fixture
    def backend_options(self, tmp_path):
        return {"path": str(tmp_path / "store")}


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
