"""The LMDB backend against a real LMDB environment on disk."""

import os
import stat
import subprocess

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
    with pytest.raises(ConfigError, match=r"unknown option.*bogus.*accepted: path"):
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
