"""LMDB backend: the embedded default, a directory on local disk.

LMDB gives multi-process readers and one writer at a time with crash-safe copy-on-write
pages, and its reads are pointers into a memory map, so a load copies once: from the
map straight into the caller's staging buffer.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvconn.backend import Backend, Capabilities
from kvconn.errors import BackendError, ConfigError

__all__ = ["LmdbBackend", "default_path"]

_GROWTH = 2
_OPEN: dict[tuple[int, str], tuple[Any, int]] = {}  # (pid, realpath) -> (env, refcount)
_OPEN_LOCK = threading.Lock()


def default_path() -> Path:
    """``$XDG_CACHE_HOME/kvconn/lmdb`` (``~/.cache/kvconn/lmdb``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvconn" / "lmdb"


class LmdbBackend(Backend):
    name: ClassVar[str] = "lmdb"
    extra: ClassVar[str | None] = "lmdb"
    client_modules: ClassVar[tuple[str, ...]] = ("lmdb",)
    capabilities: ClassVar[Capabilities] = Capabilities(delete=True, listing=True)
    max_key_length: ClassVar[int] = 250  # LMDB allows 511; keep the common limit

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        map_size: int = 1 << 30,
        max_map_size: int | None = None,
        sync: bool = False,
        max_readers: int = 512,
    ) -> None:
        """Open (creating if needed) the store at ``path``.

        ``sync=False`` keeps LMDB's integrity guarantees but may lose the last commits on
        a machine crash: right for a cache, where a lost page is only a miss.
        """
        import lmdb

        self._lmdb = lmdb
        if isinstance(map_size, bool) or not isinstance(map_size, int) or map_size < 1 << 20:
            raise ConfigError(f"lmdb: map_size must be an int >= 1 MiB, got {map_size!r}")
        if max_map_size is not None and max_map_size < map_size:
            raise ConfigError("lmdb: max_map_size must be >= map_size")
        self.path = Path(path).expanduser() if path is not None else default_path()
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"lmdb: cannot create directory {self.path}: {exc}") from exc
        if not self.path.is_dir():
            raise ConfigError(f"lmdb: {self.path} is not a directory")
        self._max_map_size = max_map_size
        self._map_size = map_size
        self._sync = bool(sync)
        self._max_readers = max_readers
        self._key = (os.getpid(), os.path.realpath(self.path))
        self._env = self._acquire()
        self._closed = False

    # LMDB forbids opening one environment twice in a process (its locks are per
    # process); share one handle per (process, path) and never reuse one across fork.
    def _acquire(self) -> Any:
        with _OPEN_LOCK:
            entry = _OPEN.get(self._key)
            if entry is not None:
                _OPEN[self._key] = (entry[0], entry[1] + 1)
                return entry[0]
            try:
                env = self._lmdb.open(
                    str(self.path),
                    map_size=self._map_size,
                    subdir=True,
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
            _OPEN[self._key] = (env, 1)
            return env

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if os.getpid() != self._key[0]:
            # Inherited across fork: closing would drop the parent's LMDB locks (they
            # are per process and per file), so the child only forgets the handle.
            return
        with _OPEN_LOCK:
            env, count = _OPEN[self._key]
            if count > 1:
                _OPEN[self._key] = (env, count - 1)
            else:
                del _OPEN[self._key]
                env.close()

    def _txn_env(self) -> Any:
        if self._closed:
            raise BackendError("lmdb: the backend is closed")
        if os.getpid() != self._key[0]:
            raise BackendError(
                "lmdb: this backend was opened in another process; open a new one after fork"
            )
        return self._env

    def _read(self, fn: Any) -> Any:
        env = self._txn_env()
        try:
            with env.begin(buffers=True) as txn:
                return fn(txn)
        except self._lmdb.MapResizedError:
            pass  # another process grew the map: adopt its size and read again
        except self._lmdb.Error as exc:
            raise BackendError(f"lmdb: read failed in {self.path}: {exc}") from exc
        try:
            env.set_mapsize(0)
            with env.begin(buffers=True) as txn:
                return fn(txn)
        except self._lmdb.Error as exc:
            raise BackendError(f"lmdb: read failed in {self.path}: {exc}") from exc

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        encoded = [k.encode() for k in keys]
        return self._read(lambda txn: [txn.get(k) is not None for k in encoded])  # type: ignore[no-any-return]

    def _get(self, keys: list[str], buffers: list[memoryview]) -> Sequence[bool]:
        encoded = [k.encode() for k in keys]

        def copy(txn: Any) -> list[bool]:
            out = []
            for key, buf in zip(encoded, buffers):
                value = txn.get(key)
                if value is None or len(value) != buf.nbytes:
                    out.append(False)
                    continue
                buf[:] = value  # straight from the memory map into the caller's buffer
                out.append(True)
            return out

        return self._read(copy)  # type: ignore[no-any-return]

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        encoded = [k.encode() for k in keys]
        env = self._txn_env()
        lmdb = self._lmdb
        while True:
            try:
                with env.begin(write=True) as txn:
                    for key, value in zip(encoded, values):
                        txn.put(key, value, overwrite=False)  # first writer wins
                return [True] * len(keys)
            except lmdb.MapFullError:
                self._grow(env, sum(v.nbytes for v in values))
            except lmdb.MapResizedError:
                env.set_mapsize(0)
            except (lmdb.Error, OSError) as exc:
                raise self._write_error(exc, sum(v.nbytes for v in values)) from exc

    def _grow(self, env: Any, batch_bytes: int) -> None:
        try:
            self._grow_map(env, batch_bytes)
        except self._lmdb.Error as exc:
            raise self._write_error(exc, batch_bytes) from exc

    def _grow_map(self, env: Any, batch_bytes: int) -> None:
        current = env.info()["map_size"]
        target = max(current * _GROWTH, current + 2 * batch_bytes)
        if self._max_map_size is not None:
            if current >= self._max_map_size:
                raise BackendError(
                    f"lmdb: {self.path} is full at max_map_size={self._max_map_size} bytes"
                )
            target = min(target, self._max_map_size)
        env.set_mapsize(target)

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
        env = self._txn_env()
        try:
            with env.begin(write=True) as txn:
                return [bool(txn.delete(k.encode())) for k in keys]
        except self._lmdb.Error as exc:
            raise self._write_error(exc) from exc

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        env = self._txn_env()
        start = prefix.encode()
        with env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return
            for key, value in cursor:
                key_bytes = bytes(key)
                if not key_bytes.startswith(start):
                    break
                yield key_bytes.decode(), len(value)
